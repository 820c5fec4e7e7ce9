"""`ReplicaSet`: data-parallel engine replicas behind one `AsyncLLMEngine`, each request routed by a
router of `policies/routing` (the same objects that route the simulated fleet).

A replica is an id, the `EngineHost` that runs its engine (a core process started by a launcher,
engine/online/replica_launcher.py), its KV pool, the requests it holds, and why it left the rotation
if it did; its reports (`ReplicaReport`, sent with each step's results) go to the fleet's view of it. The set is itself an `EngineHost`, so `AsyncLLMEngine` (streams,
aborts, the waiting cap) and the HTTP app are the same for one engine and for N.

- Routing: each request is routed when it is handed over, through a `RemoteFleet`
  (policies/routing/replica_report.py). The router reads one `ReplicaSnapshot` per live replica,
  built from the replica's newest report and the requests the set routed to it and that have not
  ended (`num_outstanding`, exact here); with `refresh_s` > 0 the snapshots are rebuilt only at
  each refresh (`RefreshClock`), as in the simulated fleet.
- Aborts go to the replica that holds the request.
- A replica whose host ends (its process exits or its loop raises) leaves the rotation: each request
  it held fails at once with `ReplicaFailedError` naming the replica and why, the others keep
  serving. Only when no replica is left does the set end (the engine dies, /health says 503).
- A replica that is alive but hung (stopped, or a step that never returns) leaves the rotation the
  same way: one with requests outstanding that has sent nothing for `timeout_s` is declared hung
  by a watchdog on the event loop, and its host is terminated (its process: terminate, then kill).
  The silence is counted from its last message, or from the request that ended a time with none
  outstanding: an idle replica is silent by right, and a replica is ready (its engine built, its
  CUDA graphs captured) before it gets any request. A stepping core sends at least one message a
  second (engine/online/engine_core.py: `HEARTBEAT_S`), so only a step that lasts `timeout_s`
  reads as hung.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.offline.outputs import RequestFailedError, short_error
from engine.offline.tokenizer import encode_prompt
from engine.online.engine_stats import EngineStats
from engine.online.host import EngineHost, NewRequest, ResultSink, StepResult
from policies.registry import Registry
from policies.request import Request
from policies.routing import RemoteFleet, Router

_log = logging.getLogger(__name__)


# What starts one replica (engine/online/replica_launcher.py: `local`; ray_launcher.py: `ray`):
# (replica id, the set's EngineArgs, data_parallel_size, keep_trace, report_index) -> its Replica.
Launcher = Callable[[int, Any, int, bool, bool], "Replica"]
REPLICA_LAUNCHERS: Registry[Launcher] = Registry("replica launcher", field="replica_launcher")

DEFAULT_TIMEOUT_S = 60.0  # longer than any step of a ready engine (a long prefill on a slow GPU)


def check_replica_timeout(timeout_s: object, name: str = "replica_timeout_s") -> float:
    """`timeout_s`, checked: a finite number of seconds > 0 (`name`: the option, for the error)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"{name}={timeout_s!r} is invalid: must be a finite number of seconds > 0 (how long a "
                         "replica with requests may send nothing before it counts as hung)")
    return float(timeout_s)


class ReplicaFailedError(RequestFailedError):
    """The replica holding the request stopped; the request ended with it (HTTP 500)."""


@dataclass(slots=True)
class Replica:
    replica: int  # its id: its index in the set
    host: EngineHost
    block_size: int  # its KV pool, for the router before its first report
    num_gpu_blocks: int
    requests: set[str] = field(default_factory=set)  # handed to it and not ended
    error: str | None = None  # why it left the rotation; None while it serves
    heard: float = 0.0  # time.monotonic() of its last message, or of its first request after none
    stopping: asyncio.Task | None = None  # its host's termination, once it was declared hung

    @property
    def alive(self) -> bool:
        return self.error is None


@dataclass(slots=True, frozen=True)
class ReplicaStatus:
    """One replica as /metrics and /health show it."""

    replica: int
    alive: bool
    error: str | None
    num_outstanding: int
    stats: EngineStats


class ReplicaSet(EngineHost):
    def __init__(self, replicas: Sequence[Replica], router: Router, refresh_s: float = 0.0,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not replicas:
            raise ValueError("data_parallel_size=0 is invalid: a replica set needs at least one replica")
        self.timeout_s = check_replica_timeout(timeout_s)
        self.replicas = list(replicas)
        self.info = self.replicas[0].host.info
        self.router = router
        self.fleet = RemoteFleet(router, [(r.block_size, r.num_gpu_blocks) for r in self.replicas], refresh_s)
        self._owner: dict[str, Replica] = {}  # request id -> the replica holding it
        self._sink: ResultSink | None = None
        self._ended = False
        self._start = time.monotonic()
        self._watch: asyncio.TimerHandle | None = None  # the next look for hung replicas

    # ---- EngineHost ----------------------------------------------------------------------------
    def bind(self, loop: asyncio.AbstractEventLoop, sink: ResultSink) -> None:
        self._sink = sink
        for replica in self.replicas:
            if replica.alive:
                replica.host.bind(loop, lambda result, r=replica: self._on_result(r, result))
        if self._watch is not None:
            self._watch.cancel()
        self._watch = loop.call_later(self._watch_period, self._look_for_hung)

    @property
    def is_running(self) -> bool:
        return self._sink is not None and not self._ended and any(r.alive for r in self.replicas)

    def add(self, request: NewRequest) -> None:
        replica = self.replicas[self.route(request)]
        self._owner[request.request_id] = replica
        if not replica.requests:  # its silence counts from now on
            replica.heard = time.monotonic()
        replica.requests.add(request.request_id)
        replica.host.add(request)

    def abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None and replica.alive:
            replica.host.abort(request_id)

    def num_waiting(self) -> int:
        return sum(r.host.num_waiting() for r in self.replicas if r.alive)

    def stats(self) -> EngineStats:
        """The fleet's counts: sums over the live replicas (counters over all), KV usage over their
        pools together."""
        every = [r.host.stats() for r in self.replicas]
        live = [(r, s) for r, s in zip(self.replicas, every) if r.alive]
        total = sum(r.num_gpu_blocks for r, _ in live)
        usage = sum(s.kv_cache_usage * r.num_gpu_blocks for r, s in live) / total if total else 0.0
        return EngineStats(sum(s.num_running for _, s in live), sum(s.num_waiting for _, s in live),
                           sum(s.num_swapped for _, s in live), usage,
                           *(sum(getattr(s, f) for s in every) for f in _COUNTERS))

    def replica_status(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(r.replica, r.alive, r.error, len(r.requests), r.host.stats()) for r in self.replicas]

    def health_problem(self) -> str | None:
        if any(r.alive for r in self.replicas):
            return None
        return "every replica has stopped: " + "; ".join(f"replica {r.replica}: {r.error}" for r in self.replicas)

    def health_detail(self) -> dict[str, Any]:
        return {"replicas": [{"replica": s.replica, "alive": s.alive, "error": s.error,
                              "num_outstanding": s.num_outstanding} for s in self.replica_status()]}

    async def shutdown(self) -> None:
        self._ended = True
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(r.stopping or r.host.shutdown() for r in self.replicas), return_exceptions=True)

    # ---- routing --------------------------------------------------------------------------------
    @property
    def num_routed(self) -> list[int]:
        return list(self.fleet.num_routed)

    def route(self, request: NewRequest) -> int:
        """The id of the replica the router picks for `request` (it counts as outstanding there)."""
        return self.fleet.route(self._routed_request(request), time.monotonic() - self._start)

    def _routed_request(self, r: NewRequest) -> Request:
        """The request as a router reads it (prompt token ids only where the router reads them)."""
        ids: list[int] = []
        if self.router.reads_prefix_index:
            ids = list(r.prompt) if not isinstance(r.prompt, str) else self._encode(r.prompt)
        return Request(r.request_id, ids, r.params, r.arrival, r.priority, tenant=r.tenant)

    def _encode(self, text: str) -> list[int]:
        try:
            return encode_prompt(self.info.tokenizer, text)
        except ValueError:  # no tokenizer: the replica refuses the prompt, naming the field
            return []

    # ---- results --------------------------------------------------------------------------------
    def _on_result(self, replica: Replica, result: StepResult | BaseException) -> None:
        if not replica.alive:  # declared hung: what it sends before it is terminated comes too late
            return
        if isinstance(result, BaseException):
            self._lose(replica, result)
            return
        replica.heard = time.monotonic()
        if result.report is not None:
            self.fleet.update(replica.replica, result.report)
        for request_id in result.errors:
            self._release(request_id)
        outputs = []
        for output, record in result.outputs:
            if output.finished:
                self._release(output.request_id)
            if record is not None:
                record = dataclasses.replace(record, replica=replica.replica)
            outputs.append((output, record))
        self._sink(StepResult(result.errors, outputs))

    def _release(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            replica.requests.discard(request_id)
            self.fleet.ended(replica.replica)

    # ---- hung replicas --------------------------------------------------------------------------
    @property
    def _watch_period(self) -> float:
        return min(1.0, self.timeout_s / 4)

    def _look_for_hung(self) -> None:
        """Each live replica with requests that has been silent for `timeout_s` is hung; look again
        a period later (so one is found within `timeout_s` plus a period)."""
        now = time.monotonic()
        for replica in self.replicas:
            silent = now - replica.heard
            if replica.alive and replica.requests and silent >= self.timeout_s:
                self._lose(replica, TimeoutError(
                    f"hung: no step result for {silent:.1f} s with {len(replica.requests)} request(s) outstanding "
                    f"(replica timeout {self.timeout_s:g} s, --replica-timeout-s); its process is terminated"))
                replica.stopping = asyncio.ensure_future(replica.host.terminate())
        if not self._ended:
            self._watch = asyncio.get_running_loop().call_later(self._watch_period, self._look_for_hung)

    def _lose(self, replica: Replica, error: BaseException) -> None:
        """The replica's host ended: out of rotation, its requests fail, the set ends with the last."""
        if not replica.alive:
            return
        replica.error = short_error(error)
        self.fleet.lose(replica.replica)
        _log.error("replica %d stopped; it leaves the rotation: %s", replica.replica, replica.error)
        held, replica.requests = replica.requests, set()
        for request_id in held:
            self._owner.pop(request_id, None)
        why = f"replica {replica.replica} stopped: {replica.error}"
        if held:
            self._sink(StepResult({request_id: ReplicaFailedError(why) for request_id in held}, []))
        problem = self.health_problem()
        if problem is not None and not self._ended:
            self._ended = True
            self._sink(RuntimeError(problem))


_COUNTERS = ("num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
             "num_requests_finished_total", "num_steps_total")
