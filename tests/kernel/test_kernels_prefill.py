"""Triton prefill/extend attention over a paged prefix (interpreted) against the float64 reference."""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from property_settings import examples

from kernels import reference
from kernels.decode import paged_decode_attention
from kernels.inputs import random_paged_problem
from kernels.prefill import PrefillConfig, paged_prefill_attention

# Shrinking re-runs interpreted kernels hundreds of times; the first failing example is reported as is.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _check(
    context_lens, q_lens, group, num_kv_heads, head_dim, block_size, dtype, config, seed, pass_max_seqlen=True
):
    prob = random_paged_problem(
        context_lens, q_lens, group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype, seed=seed
    )
    out = torch.full_like(prob.q, float("nan"))
    max_q = prob.max_seqlen_q if pass_max_seqlen else None
    paged_prefill_attention(*prob.prefill_args(), max_q, config=config, out=out)
    ref = reference.paged_prefill_attention(*prob.to(torch.float64).prefill_args())
    assert not out.isnan().any(), "output not fully written"
    assert _rel_err(out, ref) < TOL[dtype]


@settings(max_examples=examples(25), deadline=None, phases=NO_SHRINK)
@given(
    data=st.data(),
    group=st.sampled_from([1, 2, 4, 8]),
    num_kv_heads=st.integers(1, 2),
    head_dim=st.sampled_from([16, 64]),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    tiles=st.sampled_from([(16, 16), (32, 16), (16, 32), (64, 32)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_prefill_matches_reference(data, group, num_kv_heads, head_dim, block_size, dtype, tiles, seed):
    """Ragged batches: fresh prompts (no prefix), chunks after a cached prefix, single tokens."""
    num_seqs = data.draw(st.integers(1, 3))
    q_lens = data.draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs))
    prefix = data.draw(
        st.lists(
            st.one_of(st.just(0), st.integers(0, 50), st.sampled_from([block_size, 2 * block_size])),
            min_size=num_seqs,
            max_size=num_seqs,
        )
    )
    context_lens = [p + q for p, q in zip(prefix, q_lens)]
    _check(
        context_lens,
        q_lens,
        group,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        PrefillConfig(block_m=tiles[0], block_n=tiles[1]),
        seed,
        pass_max_seqlen=data.draw(st.booleans()),
    )


@pytest.mark.parametrize(
    "q_lens,prefix", [([1], [0]), ([16, 32], [0, 0]), ([17, 31], [16, 15]), ([33], [64])]
)
def test_prefill_edge_lengths(q_lens, prefix):
    """Single token, tile- and block-aligned lengths, prefix ending mid-block."""
    context_lens = [p + q for p, q in zip(prefix, q_lens)]
    _check(
        context_lens,
        q_lens,
        2,
        2,
        64,
        16,
        torch.float16,
        PrefillConfig(block_m=16, block_n=16),
        seed=len(q_lens),
    )


def test_prefill_of_one_token_equals_decode():
    prob = random_paged_problem([5, 80, 33], [1, 1, 1], 8, 2, 64, 16, torch.float32, seed=11)
    out = paged_prefill_attention(*prob.prefill_args(), config=PrefillConfig(block_m=16, block_n=32))
    dec = paged_decode_attention(
        prob.q, prob.k_cache, prob.v_cache, prob.block_tables, prob.context_lens, prob.scale
    )
    torch.testing.assert_close(out, dec, rtol=1e-5, atol=1e-6)


def test_prefill_empty_sequence_in_batch():
    """A sequence with zero new tokens (cu_seqlens repeats) contributes nothing and breaks nothing."""
    _check(
        [20, 7, 40], [5, 0, 40], 2, 1, 16, 16, torch.float32, PrefillConfig(block_m=16, block_n=16), seed=2
    )


def test_prefill_rejects_bad_inputs():
    prob = random_paged_problem([9], [9], 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(
            prob.q,
            prob.k_cache,
            prob.v_cache,
            prob.block_tables,
            prob.cu_seqlens_q.long(),
            prob.context_lens,
            1.0,
        )
    with pytest.raises(ValueError, match="out"):
        paged_prefill_attention(*prob.prefill_args(), out=torch.empty(3, 4, 16))


def test_prefill_large_logits_stay_finite():
    prob = random_paged_problem([200, 90], [70, 90], 4, 2, 64, 16, torch.float32, seed=8)
    prob.q *= 40.0
    out = paged_prefill_attention(*prob.prefill_args(), config=PrefillConfig(block_m=16, block_n=16))
    ref = reference.paged_prefill_attention(*prob.to(torch.float64).prefill_args())
    assert out.isfinite().all() and _rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("pack_gqa", [True, False])
def test_prefill_gqa_packing(pack_gqa):
    """Query heads of one KV head packed into the rows of a tile (pack 4 here) or one head per program."""
    _check(
        [40, 70],
        [40, 23],
        4,
        2,
        16,
        16,
        torch.float16,
        PrefillConfig(block_m=64, block_n=16, pack_gqa=pack_gqa),
        seed=21,
    )
