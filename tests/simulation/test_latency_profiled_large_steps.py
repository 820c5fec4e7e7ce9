"""Prefill steps beyond a profile's largest prefill row (a spec without chunked prefill schedules up
to 8,192 tokens a step; the committed profiles go to ~2,000): the grid extends its last segment, and
the layout correction removes the grid rows' own attention as the grid prices it there, so a step's
price grows with every prompt it holds."""
from __future__ import annotations

from pathlib import Path

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sim.latency import ProfiledModel
from sim.latency.base import BatchShape
from tests.property_settings import examples

ROOT = Path(__file__).resolve().parents[2]
MODEL = ProfiledModel(ROOT / "experiments" / "profiles" / "h200-qwen3-0.6b-async.csv", 16, async_scheduling=True)


def prompts(n: int, q: int) -> BatchShape:
    chunks = tuple((q, 0) for _ in range(n))
    return BatchShape(num_prefill_tokens=n * q, num_prefill_seqs=n, num_samples=n, prefill_chunks=chunks,
                      prefill_attention_pairs=n * q * (q + 1) // 2)


@settings(max_examples=examples(60), deadline=None)
@given(q=st.integers(64, 2048), n=st.integers(1, 15))
def test_beyond_the_grid_one_more_prompt_never_makes_a_step_cheaper(q, n):
    """(Within the grid a step padded to a CUDA-graph size may cost what a larger one does.)"""
    assume(n * q > MODEL.axes.prefill[-1])
    assert MODEL.shape_time(prompts(n + 1, q)) >= MODEL.shape_time(prompts(n, q))


def test_a_large_prefill_step_costs_about_its_tokens_at_the_grids_last_rate():
    """Eight 1,024-token prompts: about twice four (the GEMMs dominate; each prompt's attention is
    the same), where removing one 8,192-token prompt's quadratic attention priced it below four."""
    four, eight = MODEL.shape_time(prompts(4, 1024)), MODEL.shape_time(prompts(8, 1024))
    assert 1.6 < eight / four < 2.2
    assert MODEL.axes.prefill[-1] < 4 * 1024  # both beyond the grid
