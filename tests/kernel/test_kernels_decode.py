"""Triton paged decode attention (interpreted on the CPU) against the float64 reference."""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from property_settings import examples

from kernels import decode, decode_splits, decode_tma, reference
from kernels.decode import DecodeConfig, paged_decode_attention
from kernels.decode_packed import PackedDecodeConfig, tma_ok
from kernels.decode_tma import TmaDecodeConfig, tma_decode_supported
from kernels.inputs import block_is_dense, kv_cache_storage, random_paged_problem

# Shrinking re-runs interpreted kernels hundreds of times; the first failing example is reported as is.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _check(context_lens, group, num_kv_heads, head_dim, block_size, dtype, config, seed, order=None):
    prob = random_paged_problem(
        context_lens, None, group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype, seed=seed
    )
    prob.poison_stale_slots()
    out = torch.full_like(prob.q, float("nan"))
    if order == "longest_first":
        order = torch.argsort(prob.context_lens, descending=True, stable=True).to(torch.int32)
    elif order == "random":
        order = torch.randperm(len(context_lens), generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    paged_decode_attention(*prob.decode_args(), config=config, out=out, order=order)
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert not out.isnan().any(), "output not fully written"
    empty = torch.tensor(context_lens) == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    if not empty.all():
        assert _rel_err(out, ref) < TOL[dtype]


@settings(max_examples=examples(25), deadline=None, phases=NO_SHRINK)
@given(
    data=st.data(),
    group=st.sampled_from([1, 2, 4, 8]),
    num_kv_heads=st.integers(1, 2),
    head_dim=st.sampled_from([16, 64, 128]),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    num_splits=st.sampled_from([None, 1, 2, 3]),
    block_n=st.sampled_from([16, 32]),
    heads_fastest=st.booleans(),
    order=st.sampled_from([None, "longest_first", "random"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_decode_matches_reference(
    data, group, num_kv_heads, head_dim, block_size, dtype, num_splits, block_n, heads_fastest, order, seed
):
    lens = data.draw(
        st.lists(
            st.one_of(st.integers(1, 100), st.sampled_from([block_size, 2 * block_size])),
            min_size=1,
            max_size=4,
        )
    )
    _check(
        lens,
        group,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        DecodeConfig(block_n=block_n, num_splits=num_splits, heads_fastest=heads_fastest),
        seed,
        order,
    )


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_launch_order_changes_nothing(num_splits):
    """Sequences launched longest first or in reverse (24 or 48 programs: more than the CPU stand-in's
    16 slots, so the order is used): every row bitwise as in batch order."""
    lens = [5, 70, 0, 33, 16, 1, 40, 17, 2, 64, 9, 31]
    prob = random_paged_problem(lens, None, 4, 2, 64, 16, torch.float32, seed=3)
    config = DecodeConfig(num_splits=num_splits)
    plain = paged_decode_attention(*prob.decode_args(), config=config)
    for order in (torch.argsort(prob.context_lens, descending=True), torch.arange(len(lens) - 1, -1, -1)):
        assert torch.equal(paged_decode_attention(*prob.decode_args(), config=config, order=order.to(torch.int32)), plain)


def test_launch_order_only_past_one_wave():
    order = torch.arange(3, dtype=torch.int32)
    assert decode_splits.launch_order(order, programs=16, slots=16) is None
    assert decode_splits.launch_order(order, programs=17, slots=16) is order
    assert decode_splits.launch_order(None, programs=17, slots=16) is None


@pytest.mark.parametrize("order", [torch.arange(4, dtype=torch.int32), torch.arange(5), torch.arange(5.0)])
def test_decode_launch_order_checked(order):
    prob = random_paged_problem([5, 70, 0, 33, 16], None, 4, 2, 64, 16, torch.float32, seed=3)
    with pytest.raises(ValueError, match=r"order=.* is invalid: expected \(5,\) torch.int32"):
        paged_decode_attention(*prob.decode_args(), order=order)


@settings(max_examples=examples(30), deadline=None, phases=NO_SHRINK)
@given(
    data=st.data(),
    group=st.sampled_from([1, 2, 4, 8]),
    num_kv_heads=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([16, 64, 128]),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    block_n=st.sampled_from([8, 16, 32]),
    use_tma=st.booleans(),
    programs_per_sm=st.integers(1, 4),
    min_split_tokens=st.sampled_from([1, 16, 256]),
    seed=st.integers(0, 2**31 - 1),
)
def test_packed_decode_matches_reference(
    data, group, num_kv_heads, head_dim, block_size, dtype, block_n, use_tma, programs_per_sm, min_split_tokens,
    seed,
):  # fmt: skip
    """Ragged batches (empty sequences too) split over 4..16 programs, TMA and pointer loads."""
    lens = data.draw(
        st.lists(
            st.one_of(st.integers(0, 100), st.sampled_from([block_size, 2 * block_size, block_size + 1])),
            min_size=1,
            max_size=6,
        )
    )
    config = PackedDecodeConfig(
        block_n=block_n, use_tma=use_tma, programs_per_sm=programs_per_sm, min_split_tokens=min_split_tokens
    )
    _check(lens, group, num_kv_heads, head_dim, block_size, dtype, config, seed)


@pytest.mark.parametrize("use_tma", [True, False])
@pytest.mark.parametrize("lens", [[0], [0, 0, 5], [1, 0, 1], [40, 0, 0, 33, 9], [200, 1, 64]])
def test_packed_decode_splits(lens, use_tma):
    """Sequences shared by 2+ programs (merged), covered by one (written directly) and empty (zeros);
    block_n 8 inside 16-token blocks, so short last tiles start mid-block or at its start."""
    config = PackedDecodeConfig(block_n=8, use_tma=use_tma, programs_per_sm=2, min_split_tokens=8)
    _check(lens, 2, 2, 64, 16, torch.float32, config, seed=len(lens))


def test_packed_decode_merges_more_partials_than_one_step():
    """One sequence over 20 programs: the merge takes its partials 16 at a time."""
    config = PackedDecodeConfig(block_n=8, programs_per_sm=5, min_split_tokens=8)
    _check([400, 3], 4, 1, 16, 16, torch.float32, config, seed=11)


@pytest.mark.parametrize("lens", [[1], [1, 1, 1], [16, 32, 48], [17, 33, 15]])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_edge_lengths(lens, num_splits):
    """Single token, exact multiples of block_size, one past / one short; more splits than tiles."""
    _check(lens, 4, 2, 64, 16, torch.float16, DecodeConfig(num_splits=num_splits), seed=sum(lens))


def test_decode_default_heuristic_and_zero_context():
    """Default config (heuristic split count); a context_len of 0 (padded slot) yields zeros."""
    prob = random_paged_problem([0, 70, 5], None, 8, 2, 64, 16, torch.float32, seed=3)
    out = paged_decode_attention(*prob.decode_args())
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert _rel_err(out, ref) < 1e-5


def test_decode_strided_query_view():
    """q as a view into a fused qkv buffer (non-contiguous heads)."""
    prob = random_paged_problem([9, 40], None, 4, 2, 16, 16, torch.float32, seed=5)
    qkv = torch.randn(2, 8, 16)
    qkv[:, :4] = prob.q
    out = paged_decode_attention(qkv[:, :4], *prob.decode_args()[1:])
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(
    "config",
    [DecodeConfig(block_n=32), DecodeConfig(block_n=32, kv_eviction="evict_first"), PackedDecodeConfig()],
)
def test_decode_reads_hnd_cache_through_strides(config):
    """An HND-stored cache (kernels.inputs.kv_cache_storage) gives the NHD answer (the packed kernel
    falls back from TMA to pointer loads there)."""
    prob = random_paged_problem([9, 40, 33], None, 4, 2, 16, 16, torch.float32, seed=7)
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert tma_ok(prob.k_cache, 16)
    prob.k_cache, prob.v_cache = kv_cache_storage(prob.k_cache, "hnd"), kv_cache_storage(prob.v_cache, "hnd")
    assert not prob.k_cache.is_contiguous() and block_is_dense(prob.k_cache) and not tma_ok(prob.k_cache, 16)
    out = paged_decode_attention(*prob.decode_args(), config=config)
    assert _rel_err(out, ref) < 1e-5


def test_decode_per_head_reads_head_major_cache():
    """Head-major storage (kernels.inputs.kv_cache_storage "headmajor", one of the layouts
    experiments.lab.bench_kernels_sweep --streams compares) gives the same answer."""
    prob = random_paged_problem([9, 40, 33], None, 4, 2, 16, 16, torch.float32, seed=8)
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    prob.k_cache, prob.v_cache = (kv_cache_storage(c, "headmajor") for c in (prob.k_cache, prob.v_cache))
    assert prob.k_cache.stride(2) == prob.k_cache.shape[0] * 16 * 16
    out = paged_decode_attention(*prob.decode_args(), config=DecodeConfig(block_n=32))
    assert _rel_err(out, ref) < 1e-5


def test_decode_rejects_bad_inputs():
    prob = random_paged_problem([9], None, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(
            prob.q, prob.k_cache, prob.v_cache, prob.block_tables.long(), prob.context_lens, 1.0
        )
    with pytest.raises(ValueError, match="q.shape\\[1\\]"):
        paged_decode_attention(
            prob.q[:, :3], prob.k_cache, prob.v_cache, prob.block_tables, prob.context_lens, 1.0
        )
    with pytest.raises(ValueError, match="q.dtype"):
        paged_decode_attention(
            prob.q.half(), prob.k_cache, prob.v_cache, prob.block_tables, prob.context_lens, 1.0
        )
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_attention(*prob.decode_args(), config=DecodeConfig(block_n=24))


def test_decode_large_logits_stay_finite():
    """Scores spread over hundreds (peaked softmax): the running max must keep exp2 from overflowing."""
    prob = random_paged_problem([300, 77], None, 4, 2, 64, 16, torch.float32, seed=8)
    prob.q *= 40.0
    out = paged_decode_attention(*prob.decode_args(), config=DecodeConfig(block_n=16, num_splits=2))
    ref = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    assert out.isfinite().all() and _rel_err(out, ref) < 1e-4


def test_tma_config_falls_back_off_hopper_and_checks_its_fields():
    """Where the Gluon TMA kernel cannot run (here: the CPU interpreter) a TmaDecodeConfig runs the
    per-head kernel with the same split count; bad tile or ring sizes name the field."""
    _check([37, 5, 64], 2, 2, 64, 16, torch.float32, TmaDecodeConfig(num_splits=2), seed=4)
    prob = random_paged_problem([9], None, 4, 2, 64, 16, torch.float32, seed=1)
    assert not tma_decode_supported(prob.q, prob.k_cache, prob.v_cache, TmaDecodeConfig())
    with pytest.raises(ValueError, match="tile_tokens=24"):
        TmaDecodeConfig(tile_tokens=24)
    with pytest.raises(ValueError, match="num_bufs=1"):
        TmaDecodeConfig(num_bufs=1)
    with pytest.raises(ValueError, match="lead=3 is invalid"):
        TmaDecodeConfig(num_bufs=3, lead=3)
    with pytest.raises(ValueError, match="lead=0 is invalid"):
        TmaDecodeConfig(num_bufs=3, lead=0)
    assert TmaDecodeConfig(num_bufs=3, lead=2).steps_ahead == 2 and TmaDecodeConfig(num_bufs=3, lead=None).steps_ahead == 3


@pytest.mark.parametrize("num_splits", [1, 3])
def test_tma_host_side_passes_and_merges_the_partials(monkeypatch, num_splits):
    """The Gluon kernel runs on Hopper only; on the CPU its launch is replaced by a stub that writes
    the reference result where the kernel would (out with one split; else every split's partial row
    (b * Hq + h) * splits + s with log-sum-exp 0), so the host side (split count, partial buffers,
    argument order, the merge) is checked here and the kernel itself by the GPU tests."""
    prob = random_paged_problem([37, 5, 64], None, 4, 2, 64, 16, torch.float16, seed=6)  # TMA boxes: 16-bit
    ref = reference.paged_decode_attention(*prob.decode_args())

    class Stub:
        def __getitem__(self, grid):
            assert grid == (2, 3, num_splits)

            def launch(q, k_desc, v_desc, tables, lens, out, part_out, part_lse, *args, NUM_SPLITS, **meta):
                assert NUM_SPLITS == num_splits
                if NUM_SPLITS == 1:
                    out.copy_(ref)
                else:
                    part_out.copy_(ref.float().reshape(-1, 1, 64).expand(-1, NUM_SPLITS, -1).reshape(-1, 64))
                    part_lse.zero_()

            return launch

    monkeypatch.setattr(decode_tma, "_tma_decode_kernel", Stub())
    monkeypatch.setattr(decode, "tma_decode_supported", lambda *args: True)
    out = paged_decode_attention(*prob.decode_args(), config=TmaDecodeConfig(num_splits=num_splits))
    assert torch.allclose(out.float(), ref.float(), atol=2e-3)
