"""Async profiles (`async_scheduling=true`): each row with prefill is priced by its own step
launched back to back (the pipelined period), the synchronous price kept as `sync_time_s`."""
from __future__ import annotations

from pathlib import Path

import pytest

from experiments.lib.profiling import measure
from sim.latency import BatchShape, ProfiledModel
from sim.latency.profile_io import read_profile
from tests.runs.test_profile import assert_sum_of_parts, tiny_profile

ROOT = Path(__file__).resolve().parents[2]
STEP_KEYS = ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens")


def test_async_profile_prices_prefill_rows_by_their_pipelined_period(tmp_path):
    path, _ = tiny_profile(tmp_path / "cpu-tiny-qwen3.csv", ["async_scheduling=true"])
    file_meta, rows = read_profile(path)
    assert file_meta["async_scheduling"] == "true" and "back to back without waiting" in file_meta["timing"]
    steps = [r for _, r in rows if r["kind"] == "step"]
    assert len(steps) == 6 and all(float(r["time_s"]) > 0 for r in steps)
    for r in steps:
        assert_sum_of_parts(r)
        assert float(r["sync_time_s"]) > 0  # steps not scheduled ahead are priced from it
    ProfiledModel(path, 16, "tiny-qwen3", async_scheduling=True)


def _period_of(b: BatchShape) -> float:
    """A distinct period per (prefill tokens, prefill sequences, decodes, context)."""
    return 1e-3 + 1e-5 * b.num_prefill_tokens + 1e-4 * b.num_prefill_seqs + 1e-7 * b.num_decode_seqs \
        + 1e-8 * b.num_context_tokens


def test_each_prefill_row_gets_its_own_pipelined_period(tmp_path, monkeypatch):
    """Every row with prefill carries the period of its own shape, not that of another shape
    timed in the same sweep (the split rows, several prompts, are timed last)."""
    timed = []

    def fake_period(runner, out, warmup, repeats):
        timed.append(BatchShape.of(out))
        return _period_of(timed[-1])

    monkeypatch.setattr(measure, "pipelined_period", fake_period)
    path, _ = tiny_profile(tmp_path / "cpu-tiny-qwen3.csv", ["async_scheduling=true"])
    assert any(b.num_prefill_seqs > 1 for b in timed)  # the split rows were timed too
    _, rows = read_profile(path)
    prefill_rows = [r for _, r in rows if r["kind"] == "step" and r["num_prefill_tokens"] != "0"]
    assert len(prefill_rows) == 3  # P = 8 with D = 0, or D = 2 at two contexts
    model = ProfiledModel(path, 16, "tiny-qwen3", async_scheduling=True)
    for r in prefill_rows:
        p, d, c = (int(r[k]) for k in STEP_KEYS)
        own = _period_of(BatchShape(p, 1, 0, 0, d, c))
        assert float(r["time_s"]) == pytest.approx(own, rel=1e-6)
        assert model.lookup(p, d, c) == pytest.approx(own, rel=1e-6)


# Committed async profiles known to fail the check, by their `date`: the record of
# experiments/results/fidelity/default_auto_2115/, taken when every row with prefill got the period
# of the last shape timed. A new profile under the same name is checked.
@pytest.mark.parametrize("path", sorted((ROOT / "experiments/profiles").glob("*.csv")), ids=lambda p: p.stem)
def test_committed_async_profiles_are_never_slower_pipelined_than_synchronous(path):
    _, rows = read_profile(path)
    slow = measure.slower_pipelined([r for _, r in rows])
    assert not slow, [(r["num_prefill_tokens"], r["num_decode_seqs"], r["num_context_tokens"]) for r in slow]


def test_the_profiler_flags_a_row_timed_for_another_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(measure, "pipelined_period", lambda runner, out, warmup, repeats: 10.0)
    path, meta = tiny_profile(tmp_path / "cpu-tiny-qwen3.csv", ["async_scheduling=true"])
    assert meta["pipelined_check"] == ("4 rows with time_s > 1.15 x sync_time_s; P=0 D=0 C=0; P=8 D=0 C=0; "
                                       "P=8 D=2 C=8; P=8 D=2 C=32")
    assert read_profile(path)[0]["pipelined_check"] == meta["pipelined_check"]
