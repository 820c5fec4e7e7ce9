"""Our paged forward pass against transformers' forward on the same weights (fp32, CPU)."""
import pytest
import torch

import kernels.reference as ref
from engine.device.attention import attention_ops
from engine.device.input_batch import build_model_input
from engine.device.weights import build_model
from engine.model_loader import load_model_config
from engine.models.rope import inv_frequencies
from policies.outputs import ScheduledSeq
from policies.request import SamplingParams
from tests.engine_model_helpers import (
    ARCHS,
    BlockAllocator,
    hf_logits,
    hf_twin,
    make_seqs,
    random_prompts,
    tiny_pair,
)

BLOCK = 4


def bind_fresh_cache(model, num_blocks: int = 96) -> None:
    cfg = model.config
    shape = (num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    model.bind_kv_cache([torch.zeros(shape) for _ in model.layers], [torch.zeros(shape) for _ in model.layers])


@torch.no_grad()
def run_chunks(model, seqs, alloc, chunk: int) -> dict[int, list[torch.Tensor]]:
    """Compute every seq's tokens `chunk` at a time in shared batches; logits of every position."""
    logits = {s.seq_id: [] for s in seqs}
    while any(s.num_computed_tokens < s.num_tokens for s in seqs):
        sched = []
        for s in seqs:
            n = min(chunk, s.num_tokens - s.num_computed_tokens)
            if n:
                alloc.ensure(s, s.num_computed_tokens + n)
                sched.append(ScheduledSeq(s, n, 0))
        batch = build_model_input(sched, BLOCK, torch.device("cpu"))
        out = model.compute_logits(model(batch.input_ids, batch.positions, batch.meta))
        # rows: decode part (1 token) first, then the prefill part, each in scheduled order
        order = [s for s in sched if s.num_new_tokens == 1] + [s for s in sched if s.num_new_tokens > 1]
        row = 0
        for s in order:
            logits[s.seq.seq_id].append(out[row:row + s.num_new_tokens])
            row += s.num_new_tokens
            s.seq.num_computed_tokens += s.num_new_tokens
    return {k: torch.cat(v) for k, v in logits.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [1000, 5, 1])
def test_paged_forward_matches_transformers(arch, chunk):
    """Ragged prompts in one batch: whole prefill, chunked prefill (mixed with 1-token rows), and
    pure token-by-token decode all give transformers' logits at every position."""
    cfg, model, hf = tiny_pair(arch, seed=1)
    bind_fresh_cache(model)
    prompts = random_prompts([7, 13, 1, 22, 2], cfg.vocab_size, seed=2)
    seqs = make_seqs(prompts, SamplingParams())
    ours = run_chunks(model, seqs, BlockAllocator(BLOCK, 96), chunk)
    for s, p in zip(seqs, prompts):
        torch.testing.assert_close(ours[s.seq_id], hf_logits(hf, p), atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    cfg, model, hf = tiny_pair("llama", seed=3, rope_scaling=scaling, rope_theta=500000.0)
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    bind_fresh_cache(model)
    prompts = random_prompts([40, 9], cfg.vocab_size, seed=4)
    seqs = make_seqs(prompts, SamplingParams())
    ours = run_chunks(model, seqs, BlockAllocator(BLOCK, 96), 16)
    for s, p in zip(seqs, prompts):
        torch.testing.assert_close(ours[s.seq_id], hf_logits(hf, p), atol=1e-4, rtol=1e-4)
    # and the scaling actually changes frequencies (the test would be vacuous otherwise)
    assert not torch.equal(inv_frequencies(16, 500000.0, scaling), inv_frequencies(16, 500000.0, None))


def test_tied_embeddings_and_sampled_rows_only():
    cfg, model, hf = tiny_pair("qwen3", seed=5, tie_word_embeddings=True)
    assert model.lm_head_weight is model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())
    bind_fresh_cache(model)
    prompts = random_prompts([6, 11], cfg.vocab_size, seed=6)
    seqs = make_seqs(prompts, SamplingParams())
    alloc = BlockAllocator(BLOCK, 96)
    sched = []
    for s in seqs:
        alloc.ensure(s, s.num_tokens)
        sched.append(ScheduledSeq(s, s.num_tokens, 1))
    batch = build_model_input(sched, BLOCK, torch.device("cpu"))
    assert batch.sample_rows.tolist() == [5, 16]
    with torch.no_grad():
        last = model.compute_logits(model(batch.input_ids, batch.positions, batch.meta)[batch.sample_rows])
    assert last.shape == (2, cfg.vocab_size)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(last[i], hf_logits(hf, p)[-1], atol=1e-4, rtol=1e-4)


def test_interpreted_triton_kernels_match_reference():
    """The same forward through the Triton kernels (interpreted on CPU) as through the references."""
    cfg = load_model_config("tiny-qwen2")
    ref_model = build_model(cfg, ref, "cpu", torch.float32, seed=7)
    tri_model = build_model(cfg, attention_ops("triton", torch.device("cpu")), "cpu", torch.float32, seed=7)
    prompts = random_prompts([9, 3], cfg.vocab_size, seed=8)
    outs = []
    for model in (ref_model, tri_model):
        bind_fresh_cache(model, 16)
        seqs = make_seqs(prompts, SamplingParams())
        outs.append(run_chunks(model, seqs, BlockAllocator(BLOCK, 16), 6))
    for k in outs[0]:
        torch.testing.assert_close(outs[1][k], outs[0][k], atol=1e-4, rtol=1e-4)


def test_hf_twin_roundtrip_is_exact():
    cfg, model, hf = tiny_pair("qwen2", seed=9)
    twin = build_model(cfg, ref, "cpu", torch.float32, seed=123)  # other weights
    from engine.device.weights import load_hf_state_dict

    load_hf_state_dict(twin, hf.state_dict().items())
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(a, b), n
    assert hf_twin(twin) is not None
