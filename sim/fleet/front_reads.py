"""What reading the decode side's outputs costs a disaggregated pair's front, in the simulator.

The engine pair's front (engine/disagg/pd_engine.py) is one host loop: between its prefill
engine's steps it reads the decode process's messages (`_take_messages`) and turns them into the
requests' outputs. The decode process sends one after each decode step that has an output to give
(engine/disagg/decode_process.py; a heartbeat besides, at most once a second): every sequence of a
streaming request gives one each step, a request that wants only its final output (`output_kind`
"final_only", as the fidelity harness's runs on both backends: engine_backend.add_workload_request)
gives one when it ends. A prefill replica that schedules synchronously pays that before its next
step: `message_s` per decode-step message and `token_s` per output in it, for each such decode
step that ended while the replica was busy (in a step or its host time after one). Messages that
arrive while it waits between steps are read in that idle time. A decode step's message goes to the
front of each prefill replica whose requests it decoded (the engine pair has one front; a
simulated fleet with several prefill replicas charges each its own requests' outputs).

Off (0, 0) by default: `cluster.front_token_host_s` and `cluster.front_message_host_s`; what the
reads cost on their own is what `experiments.bench_handoff_host --decode-tokens 64` times on the
host the engines run on (docs/disaggregation-measured.md).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from policies.outputs import ScheduledSeq
from sim.fleet.front_host import check_seconds


@dataclass(slots=True, frozen=True)
class FrontReadPrice:
    """Host seconds the front pays per decode output it reads (`token_s`) and per decode-step
    message (`message_s`)."""

    token_s: float = 0.0
    message_s: float = 0.0

    def __post_init__(self) -> None:
        check_seconds("cluster.front_token_host_s", self.token_s)
        check_seconds("cluster.front_message_host_s", self.message_s)

    @property
    def on(self) -> bool:
        return bool(self.token_s or self.message_s)


@dataclass(slots=True)
class FrontReads:
    """Per prefill replica, the host time its front owes for the decode outputs read since its last
    step; `origin`: which prefill replica handed off each request."""

    price: FrontReadPrice
    origin: dict[str, int] = field(default_factory=dict)
    due: dict[int, float] = field(default_factory=dict)

    def handed_off(self, request_id: str, prefill: int) -> None:
        self.origin[request_id] = prefill

    def decode_step(self, request_ids: Iterable[str], busy: Callable[[int], bool]) -> None:
        """A decode step ended with an output for each of `request_ids`; `busy(p)`: whether prefill
        replica p's loop is in a step or its host time (it reads the message after that)."""
        outputs: dict[int, int] = {}
        for rid in request_ids:
            prefill = self.origin.get(rid)
            if prefill is not None:
                outputs[prefill] = outputs.get(prefill, 0) + 1
        for prefill, n in outputs.items():
            if busy(prefill):
                self.due[prefill] = self.due.get(prefill, 0.0) + self.price.message_s + n * self.price.token_s

    def take(self, prefill: int) -> float:
        """What prefill replica `prefill` owes before its next step (then nothing)."""
        return self.due.pop(prefill, 0.0)


def output_request_ids(scheduled: Iterable[ScheduledSeq], final_only: bool = False) -> list[str]:
    """The requests a decode step just run gives an output to the front: each sequence of a
    streaming request, and each sequence that ended in it (a request with n > 1 samples gives its
    final output once all have ended; each sample's end counts here, at most n - 1 reads too many
    for such a request). `final_only`: every request is read for its final output alone, whatever
    its `output_kind` (the fidelity harness's runs)."""
    return [s.seq.request.request_id for s in scheduled
            if s.seq.is_finished or (not final_only and s.seq.request.sampling_params.streams)]
