"""KV-cache write, block copy and swap kernels (interpreted on the CPU) against the references."""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from property_settings import examples

import kernels
from kernels import reference
from kernels.cache_write import write_kv_cache
from kernels.copy import copy_blocks, swap_blocks
from kernels.inputs import random_paged_problem

# Shrinking re-runs interpreted kernels hundreds of times; the first failing example is reported as is.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen):
    return torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)


@settings(max_examples=examples(20), deadline=None, phases=NO_SHRINK)
@given(
    num_tokens=st.integers(1, 40),
    num_kv_heads=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([16, 24, 64]),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_write_kv_cache_matches_reference(num_tokens, num_kv_heads, head_dim, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1  # padding tokens are skipped
    # K and V as views into a fused qkv projection output, as the engine has them.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    k_cache, v_cache = (_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slots)
    reference.write_kv_cache(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_written_cache_is_read_back_by_attention():
    """Write a sequence's K/V through slot mapping, then decode over it: same as the reference."""
    prob = random_paged_problem([37], None, 4, 2, 16, 16, torch.float32, seed=9)
    k, v = torch.randn(2, 37, 2, 16).unbind(0)
    table = prob.block_tables[0].long()
    slots = table[torch.arange(37) // 16] * 16 + torch.arange(37) % 16
    write_kv_cache(k, v, prob.k_cache, prob.v_cache, slots)
    out = kernels.decode.paged_decode_attention(*prob.decode_args())
    expected = torch.softmax(
        torch.einsum("hd,lhd->hl", prob.q[0], k.repeat_interleave(2, 1)) * prob.scale, -1
    )
    torch.testing.assert_close(out[0], torch.einsum("hl,lhd->hd", expected, v.repeat_interleave(2, 1)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_all_layers(dtype):
    gen = torch.Generator().manual_seed(1)
    k_caches = [_cache(12, 16, 2, 16, dtype, gen) for _ in range(3)]
    v_caches = [_cache(12, 16, 2, 16, dtype, gen) for _ in range(3)]
    expected_k, expected_v = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
    pairs = torch.tensor([[3, 0], [3, 7], [11, 4], [5, 10]])
    copy_blocks(k_caches, v_caches, pairs)
    reference.copy_blocks(expected_k, expected_v, pairs)
    for got, want in zip(k_caches + v_caches, expected_k + expected_v):
        assert torch.equal(got, want)
    assert torch.equal(k_caches[2][7], expected_k[2][3]) and not torch.equal(k_caches[2][7], k_caches[2][6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_between_pools(dtype):
    """Swap out then in between pools of different sizes; the round trip restores the blocks."""
    gen = torch.Generator().manual_seed(2)
    gpu_pool, cpu_pool = _cache(8, 16, 2, 16, dtype, gen), _cache(20, 16, 2, 16, dtype, gen)
    cpu_ref = cpu_pool.clone()
    out_pairs = torch.tensor([[1, 19], [6, 0], [2, 7]])
    swap_blocks(gpu_pool, cpu_pool, out_pairs)
    reference.swap_blocks(gpu_pool, cpu_ref, out_pairs)
    assert torch.equal(cpu_pool, cpu_ref)
    restored = _cache(8, 16, 2, 16, dtype, gen)
    swap_blocks(cpu_pool, restored, out_pairs.flip(1))
    assert torch.equal(restored[[1, 6, 2]], gpu_pool[[1, 6, 2]])


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_swap_layers_swaps_every_tensor(impl):
    """The engine's swap of all layers at once equals swap_blocks on each tensor."""
    from kernels.copy import swap_layers

    gen = torch.Generator().manual_seed(4)
    gpu = [_cache(6, 16, 2, 16, torch.float32, gen) for _ in range(3)]
    cpu = [_cache(9, 16, 2, 16, torch.float32, gen) for _ in range(3)]
    expected = [c.clone() for c in cpu]
    pairs = torch.tensor([[5, 8], [0, 2]])
    (swap_layers if impl == "triton" else reference.swap_layers)(gpu, cpu, pairs)
    for g, c, e in zip(gpu, cpu, expected):
        reference.swap_blocks(g, e, pairs)
        assert torch.equal(c, e)
    with pytest.raises(ValueError, match="lengths"):
        swap_layers(gpu, cpu[:2], pairs)


def test_block_ops_reject_bad_pairs():
    cache = torch.zeros(4, 16, 1, 16)
    with pytest.raises(ValueError, match="pairs"):
        copy_blocks([cache], [cache.clone()], torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="pairs\\[:, 1\\]"):
        copy_blocks([cache], [cache.clone()], torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(ValueError, match="k_caches"):
        reference.copy_blocks([], [], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="method"):
        swap_blocks(cache, cache.clone(), torch.tensor([[0, 1]]), method="dma")


def test_dispatch_uses_reference_on_cpu_and_triton_when_forced(monkeypatch):
    prob = random_paged_problem([30, 3], None, 4, 2, 16, 16, torch.float32, seed=4)
    calls = []
    monkeypatch.setattr(kernels.decode, "paged_decode_attention", lambda *a: calls.append("triton") or a[0])
    monkeypatch.setattr(kernels.reference, "paged_decode_attention", lambda *a: calls.append("ref") or a[0])
    kernels.paged_decode_attention(*prob.decode_args())
    monkeypatch.setattr(kernels, "BACKEND", "triton")
    kernels.paged_decode_attention(*prob.decode_args())
    monkeypatch.setattr(kernels, "BACKEND", "cuda")
    with pytest.raises(ValueError, match="BACKEND"):
        kernels.paged_decode_attention(*prob.decode_args())
    assert calls == ["ref", "triton"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_then_scatter_blocks_moves_every_tensor_in_one_staging_buffer(dtype):
    """The KV transfer's staging: blocks of every cache gathered into [tensors, blocks, ...] in
    one launch equal the reference, and scattering them into other blocks of another pool lands
    each block where asked (other blocks untouched)."""
    from kernels.copy import gather_blocks, scatter_blocks

    gen = torch.Generator().manual_seed(3)
    src = [_cache(9, 16, 2, 24, dtype, gen) for _ in range(4)]
    dst = [_cache(7, 16, 2, 24, dtype, gen) for _ in range(4)]
    ids, dst_ids = torch.tensor([5, 0, 8], dtype=torch.int64), torch.tensor([6, 1, 3], dtype=torch.int64)
    staging = torch.empty(4, 3, 16, 2, 24, dtype=dtype)
    expected = torch.empty_like(staging)
    gather_blocks(src, ids, staging)
    reference.gather_blocks(src, ids, expected)
    assert torch.equal(staging, expected)
    before = [d.clone() for d in dst]
    scatter_blocks(staging, dst, dst_ids)
    for j in range(4):
        for i in range(3):
            assert torch.equal(dst[j][dst_ids[i]], src[j][ids[i]])
        untouched = [b for b in range(7) if b not in dst_ids.tolist()]
        assert torch.equal(dst[j][untouched], before[j][untouched])


def test_gather_blocks_rejects_a_staging_buffer_of_another_shape():
    caches = [torch.zeros(4, 16, 2, 8) for _ in range(2)]
    with pytest.raises(ValueError, match="staging"):
        kernels.gather_blocks(caches, torch.tensor([1, 2]), torch.empty(2, 3, 16, 2, 8))


def test_a_transfers_cache_set_is_checked_once_and_a_new_or_bad_set_again(monkeypatch):
    """kernels/copy.py's staging: the caches' shapes and alignment are checked the first time a set
    (those tensors at those addresses) is staged, not on every message; another set is checked
    anew, and one with a cache of another block shape is refused."""
    from kernels import copy

    checks = []
    real = copy._check_caches
    monkeypatch.setattr(copy, "_check_caches", lambda caches: (checks.append(len(caches)), real(caches)))
    caches = [torch.arange(4 * 16 * 2 * 8, dtype=torch.float32).reshape(4, 16, 2, 8) + j for j in range(3)]
    ids, staging = torch.tensor([2, 0]), torch.empty(3, 2, 16, 2, 8)
    for _ in range(3):
        copy.gather_blocks(list(caches), ids, staging)
    assert checks == [3] and torch.equal(staging[1, 0], caches[1][2])
    other = [c.clone() for c in caches]
    copy.gather_blocks(other, ids, staging)
    assert checks == [3, 3]
    bad = [*other[:2], torch.zeros(4, 16, 2, 4)]
    with pytest.raises(ValueError, match="cache #2"):
        copy.scatter_blocks(staging, bad, ids)
