"""Fleet metrics of a disaggregated fleet on a hand-made trace (experiments/lib/fleet_metrics.py):
each replica counted by what its router gave it, imbalance within each role, prefill rows naming
their prefills and hand-offs, KV utilisation over the replicas that decode."""
import pandas as pd
import pytest
from test_metrics import req, step

from experiments.lib.fleet_metrics import fleet_summary

HANDOFF = {"prefill_replica": None, "decode_replica": None, "transfer_time": None, "prefill_time": None,
           "decode_wait": None, "link_wait": None, "link_time": None, "transfer_bytes": None}


def row(replica, rid, *, prefill=None, decode=None, status="finished", first=1.0):
    r = req(rid, 0.0, 0.5, first, [] if first is None else [first, 2.0], 2.0, 8, 2, status=status)
    r.update(HANDOFF, replica=replica)
    if prefill is not None:
        r.update(prefill_replica=prefill, decode_replica=decode, transfer_time=0.1, prefill_time=0.2,
                 decode_wait=0.0, link_wait=0.0, link_time=0.1, transfer_bytes=64)
    return r


def frames():
    """Replicas 0 and 1 prefill, 2 decodes. Replica 0 hands off a, b, c and d (d dropped on the way:
    its row aborted there); replica 1 hands off e and ends f at its first token."""
    rows = [row(2, rid, prefill=0, decode=2) for rid in "abc"]
    rows += [row(0, "d", status="aborted"), row(2, "e", prefill=1, decode=2), row(1, "f")]
    steps = [dict(step(0, 0.0, 1.0, 4, 0), replica=0), dict(step(0, 0.0, 1.0, 4, 0), replica=1),
             dict(step(0, 1.0, 1.0, 2, 6), replica=2)]
    return pd.DataFrame(rows), pd.DataFrame(steps)


def test_a_disaggregated_fleet_counts_each_replica_by_its_role():
    requests, steps = frames()
    s = fleet_summary(requests, steps, block_size=4, num_replicas=3, roles=["prefill", "prefill", "decode"])
    routing = s["routing"]
    assert routing["requests_per_replica"] == [4, 2, 4]  # arrivals routed (0, 1); hand-offs received (2)
    assert routing["imbalance_per_role"] == {"prefill": pytest.approx(4 / 3), "decode": 1.0}
    assert routing["imbalance"] == pytest.approx(4 / 3)
    p0, p1, d = (s["per_replica"][k] for k in "012")
    assert (p0["role"], p0["prefills"], p0["handed_off"], p0["completed"]) == ("prefill", 4, 4, 0)
    assert (p1["prefills"], p1["handed_off"], p1["completed"]) == (2, 1, 1)
    assert p0["kv_utilization"] is None and p1["kv_utilization"] is None
    assert (d["role"], d["received"], d["completed"]) == ("decode", 4, 4)
    assert d["kv_utilization"] == pytest.approx(6 / 8)
    assert s["kv_utilization"] == pytest.approx(6 / 8)  # the decode replica's steps alone


def test_a_fleet_of_mixed_replicas_is_counted_by_its_rows():
    requests, steps = frames()
    requests = requests.drop(columns=list(HANDOFF))
    s = fleet_summary(requests, steps, block_size=4, num_replicas=3)
    assert s["routing"] == {"requests_per_replica": [1, 1, 4], "imbalance": pytest.approx(2.0)}
    assert {r["role"] for r in s["per_replica"].values()} == {"mixed"}
    assert s["kv_utilization"] == pytest.approx(6 / 8 / 3)  # every replica's steps: 0, 0 and 6/8
