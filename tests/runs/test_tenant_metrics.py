"""Per-tenant metrics on a hand-made trace: service in weighted tokens and the service gap between
tenants while both wait to be admitted."""
from types import SimpleNamespace

from experiments.lib.metrics import summarize, summary_table
from experiments.lib.tenant_metrics import service_gap
from experiments.lib.traces import requests_frame, steps_frame
from tests.runs.test_metrics import req, step


def tenant_req(tenant, rid, arrival, sched, first, times, finish, prompt, out):
    row = req(rid, arrival, sched, first, times, finish, prompt, out)
    row["tenant"] = tenant
    return row


def frame(rows):
    return requests_frame(SimpleNamespace(requests=rows))


def test_per_tenant_service_and_gap():
    rows = [tenant_req("A", "a1", 0.0, 0.0, 1.0, [1.0, 2.0, 3.0], 3.0, 10, 3),
            tenant_req("A", "a2", 0.0, 2.5, 2.6, [2.6], 2.6, 5, 1),  # A waits over [0, 2.5)
            tenant_req("B", "b1", 0.0, 3.5, 4.0, [4.0], 4.0, 4, 1)]  # B waits over [0, 3.5)
    recorder = SimpleNamespace(requests=rows, steps=[step(0, 0.0, 4.0, 1, 1)], events=[], record_events=False)
    s = summarize(requests_frame(recorder), steps_frame(recorder), block_size=4)
    tenants = s["per_tenant"]["tenants"]
    assert tenants["A"]["service"] == (10 + 2 * 3) + (5 + 2 * 1) and tenants["B"]["service"] == 4 + 2 * 1
    assert tenants["A"]["request_throughput"] == 2 / 4
    # Both backlogged over [0, 2.5]: A gets 12 at 1 and 2 at 2 there, B nothing.
    assert s["per_tenant"]["service_gap_max"] == 14
    assert "of tenant A (2 req)" in summary_table(s)


def test_gap_counts_only_intervals_where_both_are_backlogged():
    a = frame([tenant_req("A", "a1", 0.0, 0.0, 1.0, [1.0, 2.0], 2.0, 2, 2),
               tenant_req("A", "a2", 0.0, 3.0, 3.5, [3.5], 3.5, 1, 1)])  # A waits over [0, 3)
    # B waits only once A no longer does.
    assert service_gap(a, frame([tenant_req("B", "b1", 5.0, 6.0, 6.5, [6.5], 6.5, 100, 1)])) == 0.0
    # B is served between A's tokens while both wait: the widest swing of the running difference
    # (A +4 at 1 -> +4, B +8 at 1.5 -> -4, A +2 at 2 -> -2: max 4 - min -4); later service is outside.
    b = frame([tenant_req("B", "b0", 0.0, 0.0, 1.5, [1.5], 1.5, 6, 1),
               tenant_req("B", "b1", 0.0, 3.0, 3.4, [3.4], 3.4, 50, 1)])
    assert service_gap(a, b) == 8.0
    assert service_gap(b, a) == 8.0


def test_no_tenant_no_section():
    rows = [req("a", 0.0, 0.5, 1.0, [1.0], 1.0, 4, 1)]
    recorder = SimpleNamespace(requests=rows, steps=[step(0, 0.0, 1.0, 1, 1)], events=[], record_events=False)
    assert summarize(requests_frame(recorder), steps_frame(recorder), block_size=4)["per_tenant"] == {}
