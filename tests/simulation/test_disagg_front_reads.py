"""What reading the decode outputs costs a simulated pair's front (sim/fleet/front_reads.py): per
message and per output, owed by the prefill replica whose requests were decoded, only for decode
steps that ended while it was busy; off, the run is unchanged."""
import pandas as pd
import pytest
from test_disagg_sim import _scheduler
from test_sim import Constant

from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.fleet_backend import cluster_config
from experiments.lib.traces import requests_frame, steps_frame
from policies import Request, SamplingParams
from policies.disagg import ReplicaRole
from policies.outputs import ScheduledSeq
from policies.routing import make_router
from policies.sequence import Sequence, SequenceStatus
from sim.fleet import ReplicaSpec
from sim.fleet.disagg import DisaggFleetSimulator
from sim.fleet.front_reads import FrontReadPrice, FrontReads, output_request_ids
from sim.latency.shapes import Link

DECODE_S, PREFILL_S = 0.003, 0.01


def test_a_decode_step_is_owed_by_the_busy_fronts_of_its_requests():
    reads = FrontReads(FrontReadPrice(token_s=1e-5, message_s=1e-4))
    for rid, prefill in (("a", 0), ("b", 0), ("c", 1), ("d", 2)):
        reads.handed_off(rid, prefill)
    reads.decode_step(["a", "b", "c", "d", "x"], busy=lambda p: p != 2)  # x: not handed off; 2: idle
    assert reads.take(0) == pytest.approx(1e-4 + 2e-5) and reads.take(1) == pytest.approx(1e-4 + 1e-5)
    assert reads.take(2) == 0.0 and reads.take(0) == 0.0  # paid once


@pytest.mark.parametrize(("key", "value"), [("front_token_host_s", -1e-6), ("front_message_host_s", True),
                                            ("front_token_host_s", float("inf"))])
def test_a_bad_price_names_its_key(key, value):
    with pytest.raises(ValueError, match=rf"cluster.{key}={value!r} is invalid: must be a number of seconds >= 0"):
        cluster_config(compose_cfg(["cluster.replicas=2", "cluster.roles=[prefill,decode]", f"cluster.{key}={value}"]))


def _scheduled(kind: str, status: SequenceStatus) -> ScheduledSeq:
    request = Request(f"{kind}-{status.name}", [1, 2, 3], SamplingParams(max_tokens=4, output_kind=kind))
    return ScheduledSeq(Sequence(0, request, [1, 2, 3, 4], 3, status), 1, 1)


def test_a_decode_step_gives_the_front_outputs_of_streams_and_of_ended_sequences():
    step = [_scheduled(kind, status) for kind in ("cumulative", "delta", "final_only")
            for status in (SequenceStatus.RUNNING, SequenceStatus.FINISHED_LENGTH)]
    assert output_request_ids(step) == ["cumulative-RUNNING", "cumulative-FINISHED_LENGTH", "delta-RUNNING",
                                        "delta-FINISHED_LENGTH", "final_only-FINISHED_LENGTH"]
    # As the fidelity harness reads every request: only the ended sequences give an output.
    assert output_request_ids(step, final_only=True) == ["cumulative-FINISHED_LENGTH", "delta-FINISHED_LENGTH",
                                                         "final_only-FINISHED_LENGTH"]


def _run(price: FrontReadPrice | None, output_kind: str = "cumulative", final_outputs_only: bool = False):
    requests = [Request(f"r{i}", list(range(40)), SamplingParams(max_tokens=12, ignore_eos=True,
                                                                 output_kind=output_kind),
                        arrival_time=0.004 * i) for i in range(30)]
    specs = [ReplicaSpec(_scheduler(400), Constant(PREFILL_S)), ReplicaSpec(_scheduler(400), Constant(DECODE_S))]
    DisaggFleetSimulator(specs, [ReplicaRole.PREFILL, ReplicaRole.DECODE], make_router({"name": "round_robin"}),
                         make_router({"name": "least_kv"}), requests, [Link(10.0, 1e-5), None], [4096, 0],
                         front_reads=price, final_outputs_only=final_outputs_only).run()
    prefill = steps_frame(specs[0].scheduler.recorder).sort_values("time")
    gaps = prefill["time"].iloc[1:].to_numpy() - (prefill["time"] + prefill["duration"]).iloc[:-1].to_numpy()
    rows = pd.concat([requests_frame(s.scheduler.recorder) for s in specs])
    return gaps, rows


def test_the_prefill_replica_pays_the_reads_before_its_next_step():
    off, rows_off = _run(None)
    _, rows_zero = _run(FrontReadPrice())
    assert off.max() < 1e-12 and rows_zero.equals(rows_off)  # a zero price is no price
    on, rows_on = _run(FrontReadPrice(token_s=2e-4, message_s=1e-3))
    # Every gap is whole messages (1 ms) and outputs (0.2 ms): decode steps of 3 ms end in 10 ms steps.
    assert on.max() > 0.0015
    units = on / 2e-4
    assert units == pytest.approx(units.round(), abs=1e-6)
    assert rows_on["ttft"].mean() > rows_off["ttft"].mean()


def test_final_outputs_are_read_only_from_the_decode_steps_that_end_requests():
    price = FrontReadPrice(token_s=2e-4, message_s=1e-3)
    streamed, _ = _run(price)
    final, rows_final = _run(price, output_kind="final_only")
    harness, rows_harness = _run(price, final_outputs_only=True)  # streaming requests read as the harness does
    assert final.sum() < 0.5 * streamed.sum()  # 12 decode steps a request, one of them ends it
    assert harness == pytest.approx(final) and rows_harness["ttft"].equals(rows_final["ttft"])
    # Each request's end is read once: one message and one output (the 30 requests, 6.6 ms a gap at most).
    assert final.sum() <= 30 * (1e-3 + 2e-4) + 1e-9
