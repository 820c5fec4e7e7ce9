"""The fused q/k norm + rope + KV-cache write kernel (interpreted on the CPU) against the model's own
elementwise ops followed by the reference cache write."""
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from property_settings import examples

from engine.models.ops import apply_rope, rms_norm
from engine.models.rope import RotaryEmbedding
from kernels import reference
from kernels.qk_rope_cache import qk_norm_rope_write

NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}  # the interpreter computes bf16 wrongly


def _case(tokens: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    rope = RotaryEmbedding(head_dim, 512, 1e6, None).cos_sin[positions].to(dtype)
    num_blocks = tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.25] = -1  # padding rows: q computed, nothing written
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    weights = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype), (torch.rand(head_dim, generator=gen) + 0.5).to(dtype)
    return qkv, rope, slots, cache, weights


def _expected(qkv, rope, slots, cache, weights, heads, kv_heads, head_dim, norm: bool):
    q, k, v = qkv.float().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
    if norm:
        q, k = rms_norm(q, weights[0].float(), 1e-6), rms_norm(k, weights[1].float(), 1e-6)
    q, k = apply_rope(q, k, rope.float())
    k_cache, v_cache = cache[0].float().clone(), cache[1].float().clone()
    reference.write_kv_cache(k, v, k_cache, v_cache, slots)
    return q, k_cache, v_cache


@settings(max_examples=examples(12), deadline=None, phases=NO_SHRINK)
@given(tokens=st.integers(1, 24), heads_per_kv=st.sampled_from([1, 2, 3]), kv_heads=st.sampled_from([1, 2, 3]),
       head_dim=st.sampled_from([16, 64]), block_size=st.sampled_from([8, 16]), norm=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**31 - 1))
def test_matches_norm_rope_then_cache_write(tokens, heads_per_kv, kv_heads, head_dim, block_size, norm, dtype, seed):
    heads = heads_per_kv * kv_heads
    qkv, rope, slots, cache, weights = _case(tokens, heads, kv_heads, head_dim, block_size, dtype, seed)
    want_q, want_k, want_v = _expected(qkv, rope, slots, cache, weights, heads, kv_heads, head_dim, norm)
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    q = qk_norm_rope_write(qkv, heads, *(weights if norm else (None, None)), 1e-6, rope, k_cache, v_cache, slots)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q.float(), want_q, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(k_cache.float(), want_k, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(v_cache.float(), want_v, atol=0, rtol=0)  # v is copied, never rounded


def test_bad_inputs_name_the_field() -> None:
    qkv, rope, slots, cache, weights = _case(4, 2, 1, 16, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="qkv"):
        qk_norm_rope_write(qkv[:, :-16], 2, *weights, 1e-6, rope, cache[0], cache[1], slots)
    with pytest.raises(ValueError, match="rope"):
        qk_norm_rope_write(qkv, 2, *weights, 1e-6, rope[:3], cache[0], cache[1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope_write(qkv, 2, *weights, 1e-6, rope, cache[0], cache[1], slots.int())
    with pytest.raises(ValueError, match="q_weight and k_weight"):
        qk_norm_rope_write(qkv, 2, weights[0], None, 1e-6, rope, cache[0], cache[1], slots)


@torch.no_grad()
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])  # with and without per-head q/k norm
def test_engine_steps_with_the_fused_kernel_equal_the_reference_path(model):
    """Chunked prefill, mixed and decode steps of a runner on the interpreted Triton ops (the fused
    kernel) against one on the plain-torch references (model elementwise ops + cache write)."""
    from engine.config import CacheConfig
    from engine.device.model_runner import ModelRunner
    from engine.model_loader import load_model_config
    from policies.request import SamplingParams
    from tests.engine_model_helpers import BlockAllocator, make_seqs, random_prompts, step

    prompts = random_prompts([11, 3, 26, 7], 256, seed=5)
    results = []
    for backend in ("triton", "reference"):
        runner = ModelRunner(load_model_config(model), CacheConfig(block_size=4, num_gpu_blocks=64, swap_space=0.001),
                             max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64, device="cpu",
                             attention_backend=backend)
        assert all((layer.self_attn.fused_qk_rope_write is not None) == (backend == "triton")
                   for layer in runner.model.layers)
        seqs = make_seqs(prompts, SamplingParams(temperature=0, logprobs=2, max_tokens=6))
        alloc = BlockAllocator(4, runner.num_gpu_blocks)
        results.append([step(runner, alloc, seqs, chunk=8) for _ in range(7)])
    for fused, plain in zip(*results):
        assert fused.keys() == plain.keys()
        for seq_id in fused:
            assert fused[seq_id].token_ids == plain[seq_id].token_ids
            for a, b in zip(fused[seq_id].logprobs, plain[seq_id].logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
def test_bf16_on_the_gpu_matches_float32(norm):
    """Qwen3-0.6B's heads in bf16 on the GPU (the interpreter cannot check bf16) against the float32
    composition: within bf16 rounding of the outputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    qkv, rope, slots, cache, weights = _case(300, 16, 8, 128, 16, torch.bfloat16, 1)
    want_q, want_k, want_v = _expected(qkv, rope, slots, cache, weights, 16, 8, 128, norm)
    qkv, rope, slots, cache = qkv.cuda(), rope.cuda(), slots.cuda(), cache.cuda()
    weights = tuple(w.cuda() for w in weights) if norm else (None, None)
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    q = qk_norm_rope_write(qkv, 16, *weights, 1e-6, rope, k_cache, v_cache, slots)
    torch.testing.assert_close(q.float().cpu(), want_q, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(k_cache.float().cpu(), want_k, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(v_cache.float().cpu(), want_v, atol=0, rtol=0)
