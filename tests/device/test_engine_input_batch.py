"""The varlen input builder: order (decode rows, then prefill rows), slots, cu_seqlens, sample rows,
padding rows that change nothing (checked on CPU through the reference kernels), the packed
buffer layout, and the block-table rows kept between steps."""
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples

import kernels.reference as ref
from engine.device.batch_layout import BatchShape, InputBuffers, layout
from engine.device.block_tables import BlockTableRows
from engine.device.input_batch import BatchBuilder, build_model_input, plan_step
from engine.device.weights import build_model
from engine.model_loader import load_model_config
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
    sched = [ScheduledSeq(chunk, 5, 0), ScheduledSeq(decode, 1, 1), ScheduledSeq(prompt, 3, 1)]
    plan = plan_step(sched, BLOCK)
    assert [s.seq.seq_id for s in plan.sampled] == [0, 2]
    batch = build_model_input(sched, BLOCK, torch.device("cpu"))
    meta = batch.meta
    assert batch.input_ids.tolist() == [15, 22, 23, 24, 25, 26, 5, 6, 7]
    assert batch.positions.tolist() == [5, 2, 3, 4, 5, 6, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 9 * 4, 9 * 4 + 1, 9 * 4 + 2, 12, 13, 14]
    assert meta.num_decode_rows == 1 and meta.prefill_max_seqlen_q == 5 and meta.prefill_tiles is None
    assert meta.prefill_cu_seqlens_q.tolist() == [1, 6, 9]
    assert meta.prefill_context_lens.tolist() == [7, 3]
    assert meta.decode_context_lens.tolist() == [6]
    pad = [0] * 13  # the tables are table_width(3) = 16 columns wide
    assert meta.prefill_block_tables.tolist() == [[4, 9, 1, *pad], [3, 0, 0, *pad]]
    assert meta.decode_block_tables.tolist() == [[7, 2, 0, *pad]]
    assert batch.sample_rows.tolist() == [0, 8]


def test_decode_checks_name_the_bad_sequence():
    ok = seq(0, [1, 2, 3], 2, [0])
    short_table = seq(1, list(range(9)), 8, [0, 1])  # position 8 needs a third block of 4
    with pytest.raises(ValueError, match="seq 1: block_table holds 2 blocks"):
        plan_step([ScheduledSeq(ok, 1, 1), ScheduledSeq(short_table, 1, 1)], BLOCK)
    with pytest.raises(ValueError, match="seq 0: num_samples=1 but the step ends at token 2 of 3"):
        plan_step([ScheduledSeq(seq(0, [1, 2, 3], 1, [0]), 1, 1)], BLOCK)


@torch.no_grad()
def test_padding_rows_are_inert():
    cfg = load_model_config("tiny-llama")
    model = build_model(cfg, ref, "cpu", torch.float32, seed=0)
    shape = (16, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    k, v = [torch.randn(shape) for _ in model.layers], [torch.randn(shape) for _ in model.layers]
    model.bind_kv_cache(k, v)
    seqs = [seq(0, [1, 2, 3, 4, 5], 4, [0, 1]), seq(1, [9, 8, 7], 2, [2])]
    sched = [ScheduledSeq(s, 1, 1) for s in seqs]
    plain = build_model_input(sched, BLOCK, torch.device("cpu"))
    out = model(plain.input_ids, plain.positions, plain.meta)
    written = [c.clone() for c in k + v]
    padded_shape = BatchShape(num_tokens=4, num_decode_rows=4, num_prefill_seqs=0, num_sample_rows=4, width=2)
    builder = BatchBuilder(BLOCK, padded_shape, torch.device("cpu"))
    padded = builder.prepare(builder.plan(sched), padded_shape)
    assert padded.meta.slot_mapping.tolist()[2:] == [-1, -1]
    assert padded.meta.decode_context_lens.tolist() == [5, 3, 0, 0]
    assert padded.meta.decode_order.tolist() == [0, 1, 2, 3]  # longest context first, ties in row order
    assert padded.sample_rows.tolist() == [0, 1, 0, 0]
    out_padded = model(padded.input_ids, padded.positions, padded.meta)
    torch.testing.assert_close(out_padded[:2], out, atol=1e-6, rtol=1e-6)
    real = [(1, 0), (2, 2)]  # (block, offset) of the two real tokens: rewritten with ~equal values
    for before, after in zip(written, k + v):
        for b, o in real:
            torch.testing.assert_close(after[b, o], before[b, o], atol=1e-6, rtol=1e-6)
            after[b, o] = before[b, o]
        assert torch.equal(after, before)  # the padding rows wrote nothing
    reordered = builder.prepare(builder.plan(sched[::-1]), padded_shape)  # (the same buffers as `padded`)
    assert reordered.meta.decode_context_lens.tolist() == [3, 5, 0, 0]
    assert reordered.meta.decode_order.tolist() == [1, 0, 2, 3]


def test_layout_is_aligned_and_disjoint():
    fields, nbytes = layout(BatchShape(7, 3, 2, 5, 3, num_tiles=4))
    spans = sorted((off, off + int(np.prod(dims)) * dtype.itemsize) for off, dtype, dims in fields.values())
    assert all(off % 16 == 0 for off, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)) and spans[-1][1] <= nbytes


def test_block_table_rows_follow_every_change():
    rows = BlockTableRows(max_seqs=3, width=4)
    a, b, c = seq(0, [1], 0, [5]), seq(1, [1], 0, [6, 7]), seq(2, [1], 0, [8])
    out = np.full((2, 4), -7, dtype=np.int32)

    def gather(seqs):
        view = out[:len(seqs)]
        rows.gather(seqs, view)
        return view.tolist()

    assert gather([a, b]) == [[5, 0, 0, 0], [6, 7, 0, 0]]
    a.block_table.append(9)  # a new block
    b.block_table[1] = 3  # copy-on-write of the last block
    assert gather([b, a]) == [[6, 3, 0, 0], [5, 9, 0, 0]]
    b.block_table[:] = [1, 2]  # swapped in elsewhere: same length, other blocks
    assert gather([c, b]) == [[8, 0, 0, 0], [1, 2, 0, 0]]
    for _ in range(10):  # rows of sequences that left are recycled
        assert gather([a, c]) == [[5, 9, 0, 0], [8, 0, 0, 0]]
        assert gather([b]) == [[1, 2, 0, 0]]
    with pytest.raises(ValueError, match="scheduled twice"):
        rows.gather([a, a], out)


@settings(max_examples=examples(60), deadline=None)
@given(t=st.integers(1, 300), d=st.integers(0, 40), s=st.integers(0, 9), r=st.integers(0, 40),
       w=st.integers(1, 37), tiles=st.integers(0, 23))
def test_every_field_of_every_shape_is_16_byte_aligned(t, d, s, r, w, tiles):
    """Triton compiles one variant per combination of 16-byte-aligned pointer arguments: a field
    aligned in one shape and not in another would compile new attention-kernel variants mid-run."""
    capacity = BatchShape(300, 40, 9, 40, 37, num_tiles=23)
    views = InputBuffers(capacity, torch.device("cpu")).device_views(BatchShape(t, d, s, r, w, num_tiles=tiles))
    assert {name: v.data_ptr() % 16 for name, v in views.items() if v.data_ptr() % 16} == {}


@settings(max_examples=examples(60), deadline=None)
@given(tables=st.lists(st.integers(1, 300), min_size=1, max_size=12), decode=st.lists(st.booleans(), min_size=12,
                                                                                       max_size=12))
def test_every_step_passes_the_kernels_a_width_divisible_by_16(tables, decode):
    """Triton specializes the attention kernels on whether the block tables' stride and width are
    multiples of 16: a step whose tables were as wide as its longest one compiled new variants
    mid-run. Every eager step's tables are a multiple of 16 columns, zero past each sequence's own."""
    block = 16
    sched = []
    for i, blocks in enumerate(tables):
        n = (blocks - 1) * block + 1  # the last block holds one token
        table = [(7 * i + j) % 997 for j in range(blocks)]
        if decode[i]:
            sched.append(ScheduledSeq(seq(i, list(range(n + 1)), n, table + [1]), 1, 1))
        else:
            sched.append(ScheduledSeq(seq(i, list(range(n)), 0, table), n, 1))
    plan = plan_step(sched, block)
    shape = plan.shape()
    assert shape.width % 16 == 0 and plan.width <= shape.width < plan.width + 16
    meta = build_model_input(sched, block, torch.device("cpu")).meta
    for rows, group in ((meta.decode_block_tables, plan.decodes), (meta.prefill_block_tables, plan.prefills)):
        if not group:
            continue
        assert rows.shape[1] == shape.width
        for row, s in zip(rows.tolist(), group):
            assert row == s.seq.block_table + [0] * (shape.width - len(s.seq.block_table))
