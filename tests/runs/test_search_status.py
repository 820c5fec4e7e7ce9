"""How far a search's capacities are known (docs/search.md): brackets within rtol or wider, lower
bounds (no failing rate, or the most a trace's rows cover), why the first failing rate failed, and
the workloads whose runs would not scale with the rate."""
from __future__ import annotations

import sys

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from property_settings import examples
from test_search import TINY, cli_error, search_cfg

from experiments import search as search_module
from experiments.lib.search.capacity import RateProbe, max_sustained_rate
from experiments.lib.search.runner import run_search
from experiments.lib.search.simulate import requests_at
from experiments.lib.search.slo import SearchSlo
from experiments.lib.search.status import add_status

ONE = ["search.space.gpu=[h100]", "search.space.replicas=[1]"]  # one deployment of TINY
TRACE = [*(o for o in TINY if not o.startswith("workload")), *ONE, "workload=azure"]  # 30 rows


@hyp_settings(max_examples=examples(80), deadline=None)
@given(capacity=st.floats(0.5, 500), limit=st.floats(1, 400), iterations=st.integers(1, 14))
def test_a_rate_the_workload_cannot_offer_is_run_at_its_limit_and_bounds_the_capacity(capacity, limit, iterations):
    """A probe that can offer at most `limit` req/s runs there when asked for more: met there, the
    capacity is that limit and a lower bound; no probe ever runs above it; a status says which."""
    def probe(rate: float) -> RateProbe:
        rate = min(rate, limit)
        return RateProbe(rate, rate <= capacity)

    cap = max_sustained_rate(probe, start=2.0, max_iterations=iterations, rtol=0.05)
    assert all(p.rate <= limit for p in cap.probes) and cap.rate <= min(capacity, limit)
    if cap.limit is not None:
        assert cap.rate == limit <= capacity and cap.upper is None
    table = pd.DataFrame({"status": ["simulated"], "capacity_rps": [cap.rate], "failed_rps": [cap.upper]})
    add_status(table, 0.05)
    status = table.loc[0, "capacity_status"]
    assert status == ("lower_bound" if cap.upper is None else
                      "converged" if cap.upper - cap.rate <= 0.05 * cap.upper else "unconverged")
    if status == "unconverged":
        assert len(cap.probes) == iterations  # wider than rtol only where the iterations ran out


def test_a_pruned_row_has_no_capacity_status():
    table = pd.DataFrame({"status": ["pruned", "simulated", "simulated"], "capacity_rps": [None, 10.0, 10.0],
                          "failed_rps": [None, 10.4, 16.0]})
    add_status(table, 0.05)
    assert list(table["capacity_status"]) == ["", "converged", "unconverged"]
    assert table.loc[2, "bracket_width"] == 6 / 16


def test_a_miss_is_explained_with_its_figures():
    """Aborted requests by finish reason (a split failing on hand-off aborts, its TTFT fine), and an
    objective missed against its limit."""
    rows = [{"status": "finished", "finish_reason": "length", "ttft": 0.0078, "tpot": 0.004}] * 261 + \
           [{"status": "aborted", "finish_reason": "abort:handoff_queue_full", "ttft": None, "tpot": None}] * 43
    requests = pd.DataFrame(rows)
    goodput = SearchSlo(ttft_s=1.0, tpot_s=0.01, goodput=0.9)
    met, metrics, missed = goodput.check(requests)
    assert not met and goodput.explain(requests, metrics, missed) == (
        "goodput 0.859 < 0.9; 43 of 304 requests not finished (43 abort:handoff_queue_full); "
        "0 finished over TTFT 1 s; 0 finished over TPOT 10 ms")
    slow = SearchSlo(ttft_s=0.005)
    met, metrics, missed = slow.check(requests)
    assert slow.explain(requests, metrics, missed).startswith("TTFT p90 0.0078 s > 0.005 s; 43 of 304 requests")
    assert SearchSlo().explain(requests.iloc[:261], *SearchSlo().check(requests.iloc[:261])[1:]) == ""


def test_each_row_records_why_its_first_failing_rate_failed_and_its_request_counts(tmp_path):
    cfg = search_cfg([*TINY, *ONE, "search.space.max_num_seqs=[1]", "search.rate.start_per_replica=50"], tmp_path)
    table = run_search(cfg, tmp_path / "out", progress=False).table  # met at 50 and 200, missed at 800
    row = table.iloc[0]
    assert row["failed_because"].startswith("TTFT p90 ") and "> 2 s" in row["failed_because"]
    assert row["failed_num_requests"] == requests_at(row["failed_rps"], 2)
    assert row["num_requests"] == requests_at(row["capacity_rps"], 2)
    assert row["capacity_status"] == "unconverged" and row["bracket_width"] == 0.75


def test_a_trace_shorter_than_the_runs_bounds_the_capacity_at_what_its_rows_cover(tmp_path):
    """The azure fixture's 30 rows cover 2 s of arrivals up to 15 req/s: no run asks for more, and a
    deployment meeting the SLOs there gets a lower bound, not a capacity."""
    cfg = search_cfg([*TRACE, "search.rate.max_iterations=4"], tmp_path)
    result = run_search(cfg, tmp_path / "out", progress=False)
    row = result.table.iloc[0]
    assert row["rate_limit_rps"] == 15 and row["capacity_rps"] == 15 and row["capacity_status"] == "lower_bound"
    assert row["simulated_requests"] == 20 + 30 and pd.isna(row["failed_rps"])  # 20 at 4 req/s, then 30 at 15
    assert result.summary["capacities"]["lower_bound"] == 1 and result.cheapest["capacity_status"] == "lower_bound"


@pytest.mark.parametrize("overrides, match", [
    (["search.duration_s=20"], "search.duration_s=20 is too long for workload='azure': a run at search.target_rate=5 "
                               "req/s offers 100 requests, but it holds 30 (workload.path="),
    (["search.duration_s=null"], "search.duration_s=null measured no capacity: none of 1 deployments missed"),
])
def test_a_trace_whose_runs_do_not_scale_with_the_rate_is_refused(overrides, match, tmp_path, monkeypatch, capsys):
    """Too few rows for search.duration_s at the target rate: refused before any run; a fixed count
    of requests at every rate that no deployment ever fails (one burst its batch absorbs): refused
    rather than reported as a capacity."""
    assert match in cli_error([*TRACE, *overrides], tmp_path, monkeypatch, capsys)


def test_the_printed_summary_says_which_capacities_are_bounds(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["search", *TINY, "search.rate.max_iterations=2", *ONE,
                                      f"search.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'out'}"])
    search_module.main()
    out = capsys.readouterr().out
    assert "1 of 1 capacities are lower bounds" in out and "search.rate.max_iterations=2 (raise it)" in out
    assert "capacity >= 16 req/s, at most $" in out and "met at 16 req/s (32 requests, capacity_status=lower_bound)" in out
    assert "Pareto front: 1 deployments (1 at a lower bound)" in out


@pytest.fixture(scope="module")
def default_rate(tmp_path_factory):
    return search_cfg([], tmp_path_factory.mktemp("defaults")).search.rate


@hyp_settings(max_examples=examples(200), deadline=None)
@given(ratio=st.floats(1 / 64, 1000))
def test_the_default_bisection_converges_from_a_64th_to_a_thousand_times_its_start(ratio, default_rate):
    """conf/search.yaml's search.rate brackets any capacity from start/64 to 1000 x start within
    rtol before max_iterations runs out (the README's search: every capacity 3.6-25 x its start)."""
    rate = default_rate
    start = rate.start_per_replica
    cap = max_sustained_rate(lambda r: RateProbe(r, r <= ratio * start), start, rate.max_iterations, rate.rtol,
                             rate.growth)
    assert cap.upper is not None and cap.upper - cap.rate <= rate.rtol * cap.upper


def test_the_printed_summary_flags_brackets_wider_than_rtol(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["search", *TINY, *ONE, "search.space.max_num_seqs=[1]",
                                      "search.rate.start_per_replica=50", f"search.cache_dir={tmp_path / 'cache'}",
                                      f"hydra.run.dir={tmp_path / 'out'}"])
    search_module.main()  # met at 50 and 200, missed at 800: 3 runs leave [200, 800)
    out = capsys.readouterr().out
    assert "1 of 1 capacities are brackets wider than search.rate.rtol=0.05 (up to 75%, column bracket_width): " \
           "search.rate.max_iterations=3 ran out" in out
    assert "failed at 800 req/s (1600 requests): TTFT p90 " in out
    summary = (tmp_path / "out" / "summary.json").read_text()
    assert '"unconverged": 1' in summary and '"widest_bracket": 0.75' in summary
