"""The kernels on a CUDA GPU in bf16 at realistic sizes, against float64 references.

Run on the GPU machine (tests/conftest.py compiles the kernels for a `-m gpu` run):
    python -m pytest -q -m gpu tests/kernel/test_kernels_gpu.py
"""

import pytest
import torch

from kernels import reference
from kernels.cache_write import write_kv_cache
from kernels.copy import copy_blocks, swap_blocks
from kernels.decode import DecodeConfig, paged_decode_attention
from kernels.decode_packed import PackedDecodeConfig
from kernels.decode_tma import TmaDecodeConfig, tma_decode_supported
from kernels.inputs import kv_cache_storage, random_paged_problem
from kernels.prefill import paged_prefill_attention

pytestmark = pytest.mark.gpu
BF16_MAX_ERR = 1e-2  # bf16 operands land between 1e-3 and 1e-2 relative to float64


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _lens(n: int, low: int, high: int, seed: int) -> list[int]:
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim,block_size",
    [(16, 8, 128, 16), (32, 8, 64, 16), (14, 2, 64, 32), (8, 8, 128, 32)],
)
@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(),
        DecodeConfig(num_splits=1),
        DecodeConfig(num_splits=5),
        TmaDecodeConfig(),
        TmaDecodeConfig(num_splits=1),
        TmaDecodeConfig(num_splits=5),
        TmaDecodeConfig(tile_tokens=16, num_bufs=6),
        TmaDecodeConfig(tile_tokens=64, num_bufs=2, num_splits=3),
        TmaDecodeConfig(num_warps=4),
        TmaDecodeConfig(num_warps=2, num_bufs=3, num_splits=2),
        TmaDecodeConfig(num_bufs=3, lead=2),
        TmaDecodeConfig(tile_tokens=16, num_bufs=5, lead=4, num_splits=3),
        TmaDecodeConfig(num_bufs=3, lead=1, num_warps=4, num_splits=2),
        TmaDecodeConfig(lead=None),
        TmaDecodeConfig(tile_tokens=64, num_bufs=3, lead=None, num_warps=2, num_splits=2),
        PackedDecodeConfig(),
        PackedDecodeConfig(use_tma=False),
        PackedDecodeConfig(block_n=8, num_stages=4, programs_per_sm=2),
        PackedDecodeConfig(block_n=8, use_tma=False, programs_per_sm=3, min_split_tokens=16),
    ],
    ids=lambda c: repr(c),
)
def test_decode_bf16(num_q_heads, num_kv_heads, head_dim, block_size, config):
    lens = _lens(24, 1, 3000, seed=num_q_heads + head_dim) + [1, block_size, 4096, 0, 17]
    prob = random_paged_problem(
        lens,
        None,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.bfloat16,
        device="cuda",
        seed=head_dim,
    )
    out = torch.full_like(prob.q, float("nan"))
    prob.poison_stale_slots()  # stale slots past each context: no kernel may let them into the result
    paged_decode_attention(*prob.decode_args(), config=config, out=out)
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert not out.isnan().any()
    assert _rel_err(out, ref) < BF16_MAX_ERR


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", [(16, 8, 128, 16), (32, 8, 64, 32)])
def test_prefill_bf16(num_q_heads, num_kv_heads, head_dim, block_size):
    q_lens = _lens(6, 1, 1500, seed=1) + [1, 2048]
    prefix = _lens(6, 0, 2000, seed=2) + [100, 0]
    prob = random_paged_problem(
        [p + q for p, q in zip(prefix, q_lens)],
        q_lens,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.bfloat16,
        device="cuda",
        seed=3,
    )
    out = torch.full_like(prob.q, float("nan"))
    paged_prefill_attention(*prob.prefill_args(), out=out)
    ref = reference.paged_prefill_attention(*prob.to(torch.float64).prefill_args())
    assert not out.isnan().any()
    assert _rel_err(out, ref) < BF16_MAX_ERR


@pytest.mark.parametrize("min_split_tokens", [16, 256])
def test_packed_decode_long_single_sequence(min_split_tokens):
    """One 32k sequence split over every SM (min 16 tokens: 1 program each, 100+ partials merged)."""
    prob = random_paged_problem([32768, 5], None, 16, 8, 128, 16, torch.bfloat16, device="cuda", seed=9)
    out = paged_decode_attention(
        *prob.decode_args(), config=PackedDecodeConfig(min_split_tokens=min_split_tokens)
    )
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert _rel_err(out, ref) < BF16_MAX_ERR


def test_tma_decode_runs_where_supported():
    """The Gluon kernel is what runs for the engine's shapes (not the per-head fallback): bf16/fp16
    on this GPU with head_dim 64/128; fp32 and steps of part of a page fall back."""
    prob = random_paged_problem([5, 40], None, 16, 8, 128, 16, torch.bfloat16, device="cuda")
    assert tma_decode_supported(prob.q, prob.k_cache, prob.v_cache, TmaDecodeConfig())
    assert not tma_decode_supported(prob.q.float(), prob.k_cache.float(), prob.v_cache.float(), TmaDecodeConfig())
    big = random_paged_problem([5, 40], None, 16, 8, 128, 32, torch.bfloat16, device="cuda")
    assert not tma_decode_supported(big.q, big.k_cache, big.v_cache, TmaDecodeConfig(tile_tokens=16))


@pytest.mark.parametrize("config", [TmaDecodeConfig(), TmaDecodeConfig(tile_tokens=64, num_splits=3, num_warps=1)],
                         ids=repr)  # fmt: skip
def test_tma_decode_hnd_storage(config):
    """HND cache storage (each block's KV heads outermost): the TMA kernel reads a page's head as one
    contiguous box, with stale-slot NaNs past each context."""
    lens = _lens(12, 1, 2000, seed=3) + [1, 16, 0]
    prob = random_paged_problem(lens, None, 16, 8, 128, 16, torch.bfloat16, device="cuda", seed=2)
    prob.k_cache, prob.v_cache = kv_cache_storage(prob.k_cache, "hnd"), kv_cache_storage(prob.v_cache, "hnd")
    prob.poison_stale_slots()
    assert tma_decode_supported(prob.q, prob.k_cache, prob.v_cache, config)
    out = paged_decode_attention(*prob.decode_args(), config=config)
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert not out.isnan().any()
    assert _rel_err(out, ref) < BF16_MAX_ERR


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 2, 128), (24, 2, 64), (16, 1, 128)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_tma_decode_groups_over_8(num_q_heads, num_kv_heads, head_dim, num_splits):
    """GQA groups of 9..16 query heads take the MMA's N = 16 path of the Gluon kernel (<= 8 pad to 8)."""
    lens = _lens(10, 1, 1500, seed=5) + [1, 16, 0, 33]
    prob = random_paged_problem(lens, None, num_q_heads, num_kv_heads, head_dim, 16, torch.bfloat16,
                                device="cuda", seed=4)  # fmt: skip
    prob.poison_stale_slots()
    config = TmaDecodeConfig(num_splits=num_splits)
    assert tma_decode_supported(prob.q, prob.k_cache, prob.v_cache, config)
    out = paged_decode_attention(*prob.decode_args(), config=config)
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert not out.isnan().any()
    assert _rel_err(out, ref) < BF16_MAX_ERR


@pytest.mark.parametrize("config", [DecodeConfig(), TmaDecodeConfig(), PackedDecodeConfig()], ids=repr)
def test_decode_running_max_jumps(config):
    """Keys whose scores jump by up to ~2^5 (log2 units) at random pages mid-sequence: the online
    softmax rescales its running sums by large factors, many times per sequence."""
    lens = _lens(12, 40, 3000, seed=6) + [1, 33]
    prob = random_paged_problem(lens, None, 16, 8, 128, 16, torch.bfloat16, device="cuda", seed=6)
    gen = torch.Generator(device="cuda").manual_seed(6)
    blocks = prob.k_cache.shape[0]
    boost = torch.randint(0, 4, (blocks,), device="cuda", generator=gen) == 0  # a quarter of the pages
    factor = torch.where(boost, torch.rand(blocks, device="cuda", generator=gen) * 10 + 4, torch.ones(blocks, device="cuda"))
    prob.k_cache.mul_(factor.to(prob.k_cache.dtype)[:, None, None, None])
    prob.poison_stale_slots()
    out = paged_decode_attention(*prob.decode_args(), config=config)
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert not out.isnan().any()
    assert _rel_err(out, ref) < BF16_MAX_ERR


@pytest.mark.parametrize("config", [DecodeConfig(), DecodeConfig(num_splits=3), TmaDecodeConfig(),
                                    TmaDecodeConfig(num_splits=3), PackedDecodeConfig()], ids=repr)
def test_decode_launch_order_changes_nothing(config):
    """96 sequences x 8 KV heads (more programs than one wave: the order is used): longest first and
    reversed launch orders give every row bitwise as batch order does."""
    lens = _lens(96, 1, 3000, seed=7)
    prob = random_paged_problem(lens, None, 16, 8, 128, 16, torch.bfloat16, device="cuda", seed=7)
    prob.poison_stale_slots()
    plain = paged_decode_attention(*prob.decode_args(), config=config)
    for order in (torch.argsort(prob.context_lens, descending=True), torch.arange(95, -1, -1, device="cuda")):
        out = paged_decode_attention(*prob.decode_args(), config=config, order=order.to(torch.int32))
        assert torch.equal(out, plain)
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert _rel_err(plain, ref) < BF16_MAX_ERR


def test_decode_fp16_and_fp32():
    prob = random_paged_problem(
        _lens(16, 1, 2000, seed=4), None, 16, 8, 128, 16, torch.float16, device="cuda"
    )
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    for config in (None, PackedDecodeConfig(), TmaDecodeConfig()):
        assert _rel_err(paged_decode_attention(*prob.decode_args(), config=config), ref) < 2e-3
        assert (
            _rel_err(paged_decode_attention(*prob.to(torch.float32).decode_args(), config=config), ref) < 1e-5
        )


@pytest.mark.parametrize("config", [None, PackedDecodeConfig(), TmaDecodeConfig()], ids=["default", "packed", "tma"])
def test_decode_in_cuda_graph(config):
    """The decode launch has no host sync: it can be captured and replayed with new inputs."""
    prob = random_paged_problem([700, 30, 2000, 5], None, 16, 8, 128, 16, torch.bfloat16, device="cuda")
    out = torch.empty_like(prob.q)
    paged_decode_attention(*prob.decode_args(), config=config, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*prob.decode_args(), config=config, out=out)
    prob.q.copy_(torch.randn_like(prob.q))
    prob.context_lens.copy_(torch.tensor([1, 300, 1999, 0], dtype=torch.int32))
    graph.replay()
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert _rel_err(out, ref) < BF16_MAX_ERR


def test_write_copy_swap_bf16():
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (512, 16, 8, 128)
    k_caches = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    v_caches = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    k, v = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen).unbind(0)
    slots = torch.randperm(200 * 16, device="cuda")[:300]
    slots[::7] = -1
    expected = [c.clone() for c in k_caches[:1] + v_caches[:1]]
    write_kv_cache(k, v, k_caches[0], v_caches[0], slots)
    reference.write_kv_cache(k, v, *expected, slots)
    assert torch.equal(k_caches[0], expected[0]) and torch.equal(v_caches[0], expected[1])

    pairs = torch.stack([torch.arange(0, 100), torch.arange(300, 400)], 1)
    expected = [c.clone() for c in k_caches + v_caches]
    copy_blocks(k_caches, v_caches, pairs)
    reference.copy_blocks(expected[:3], expected[3:], pairs)
    assert all(torch.equal(a, b) for a, b in zip(k_caches + v_caches, expected))

    for method in ("kernel", "torch"):
        host = torch.randn((256, *shape[1:]), dtype=torch.bfloat16).pin_memory()
        swap_pairs = torch.stack([torch.randperm(512)[:64], torch.randperm(256)[:64]], 1)
        swap_blocks(k_caches[1], host, swap_pairs, method=method)
        torch.cuda.synchronize()
        assert torch.equal(host[swap_pairs[:, 1]], k_caches[1][swap_pairs[:, 0].cuda()].cpu())
        back = torch.zeros_like(k_caches[2])
        swap_blocks(host, back, swap_pairs.flip(1), method=method)
        torch.cuda.synchronize()
        assert torch.equal(back[swap_pairs[:, 0].cuda()], k_caches[1][swap_pairs[:, 0].cuda()])


def test_gather_scatter_blocks_bf16_at_a_models_shape():
    """A KV transfer's staging on the GPU: 28 layers' K and V (56 tensors) of 40 scattered blocks
    gathered in one launch equal the reference, and scattered into another pool's blocks land there."""
    from kernels.copy import gather_blocks, scatter_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    src = [torch.randn(300, 16, 8, 128, generator=g, device="cuda").bfloat16() for _ in range(56)]
    dst = [torch.zeros(200, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(56)]
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:40]
    dst_ids = torch.randperm(200, generator=torch.Generator().manual_seed(2))[:40]
    staging = torch.empty(56, 40, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    expected = torch.empty_like(staging)
    gather_blocks(src, ids.cuda(), staging)
    reference.gather_blocks(src, ids.cuda(), expected)
    assert torch.equal(staging, expected)
    scatter_blocks(staging, dst, dst_ids.cuda())
    for j in (0, 27, 55):
        assert torch.equal(dst[j][dst_ids.cuda()], src[j][ids.cuda()])


def test_sample_gumbel_compiles_one_kernel_for_every_seed_and_temperature_buffer():
    """A step draws with a fresh seed, and a caller may hand it temperatures at any offset:
    neither a seed divisible by 16 (or equal to 1) nor a temperature view off a 16-byte boundary
    compiles a kernel of its own in the middle of serving."""
    from kernels.sample import _chunk_best_kernel, sample_gumbel
    logits, temps = torch.randn(3, 1000, device="cuda"), torch.ones(3, device="cuda")
    sample_gumbel(logits, temps, 17)
    cache = _chunk_best_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(cache)
    for seed in (16, 32, 1, 2**20):
        sample_gumbel(logits, temps, seed)
    sample_gumbel(logits, torch.ones(5, device="cuda")[2:], 17)  # 8 bytes past an aligned base
    assert len(cache) == compiled

