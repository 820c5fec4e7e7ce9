"""The varlen input builder: order (prefill part, then decode part), slots, cu_seqlens, sample rows,
and CUDA-graph padding rows that change nothing (checked on CPU through the reference kernels)."""
import numpy as np
import torch

import kernels.reference as ref
from engine.config import load_model_config
from engine.input_batch import build_host_batch, to_device
from engine.weights import build_model
from policies.outputs import ScheduledSeq
from policies.request import Request
from policies.sequence import Sequence

BLOCK = 4


def seq(seq_id: int, tokens: list[int], computed: int, blocks: list[int]) -> Sequence:
    s = Sequence.from_request(seq_id, Request(f"r{seq_id}", tokens))
    s.num_computed_tokens = computed
    s.block_table = blocks
    return s


def test_layout_of_a_mixed_batch():
    decode = seq(0, list(range(10, 16)), 5, [7, 2])  # decode of position 5 -> block 2, offset 1
    chunk = seq(1, list(range(20, 30)), 2, [4, 9, 1])  # positions 2..6 of 10, no sample
    prompt = seq(2, [5, 6, 7], 0, [3])  # whole 3-token prompt, samples
    host = build_host_batch([ScheduledSeq(decode, 1, 1), ScheduledSeq(chunk, 5, 0),
                             ScheduledSeq(prompt, 3, 1)], BLOCK)
    assert host.input_ids.tolist() == [22, 23, 24, 25, 26, 5, 6, 7, 15]
    assert host.positions.tolist() == [2, 3, 4, 5, 6, 0, 1, 2, 5]
    assert host.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3, 9 * 4, 9 * 4 + 1, 9 * 4 + 2, 12, 13, 14, 2 * 4 + 1]
    assert host.num_prefill_tokens == 8
    assert host.prefill_cu_seqlens_q.tolist() == [0, 5, 8]
    assert host.prefill_context_lens.tolist() == [7, 3]
    assert host.decode_context_lens.tolist() == [6]
    assert host.prefill_block_tables.tolist() == [[4, 9, 1], [3, 0, 0]]
    assert host.decode_block_tables.tolist() == [[7, 2, 0]]
    assert host.sample_rows.tolist() == [7, 8]
    assert [s.seq.seq_id for s in host.sampled] == [2, 0]


@torch.no_grad()
def test_padding_rows_are_inert():
    cfg = load_model_config("tiny-llama")
    model = build_model(cfg, ref, "cpu", torch.float32, seed=0)
    shape = (16, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    k, v = [torch.randn(shape) for _ in model.layers], [torch.randn(shape) for _ in model.layers]
    model.bind_kv_cache(k, v)
    seqs = [seq(0, [1, 2, 3, 4, 5], 4, [0, 1]), seq(1, [9, 8, 7], 2, [2])]
    sched = [ScheduledSeq(s, 1, 1) for s in seqs]
    plain = to_device(build_host_batch(sched, BLOCK), torch.device("cpu"))
    out = model(plain.input_ids, plain.positions, plain.meta)
    written = [c.clone() for c in k + v]
    padded_host = build_host_batch(sched, BLOCK, pad_decode_to=4)
    assert padded_host.slot_mapping.tolist()[2:] == [-1, -1]
    assert padded_host.decode_context_lens.tolist() == [5, 3, 0, 0]
    assert np.array_equal(padded_host.sample_rows, [0, 1])
    padded = to_device(padded_host, torch.device("cpu"))
    out_padded = model(padded.input_ids, padded.positions, padded.meta)
    torch.testing.assert_close(out_padded[:2], out, atol=1e-6, rtol=1e-6)
    real = [(1, 0), (2, 2)]  # (block, offset) of the two real tokens: rewritten with ~equal values
    for before, after in zip(written, k + v):
        for b, o in real:
            torch.testing.assert_close(after[b, o], before[b, o], atol=1e-6, rtol=1e-6)
            after[b, o] = before[b, o]
        assert torch.equal(after, before)  # the padding rows wrote nothing
