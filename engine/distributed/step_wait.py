"""Rank 0's wait for a step on its GPU, bounded: it polls the step's CUDA event instead of blocking
in `cudaEventSynchronize`.

Why: a step's all-reduces may run over symmetric memory (`engine.distributed.symmetric_all_reduce`),
whose kernels' barriers spin on the GPU until every rank has arrived, with no deadline and no
abort. If a worker dies or hangs in the middle of a step, rank 0's GPU spins in that barrier
forever, and a blocking sync on the step's event would never return (NCCL's collectives have the
group's timeout and can be aborted; these cannot). So rank 0 polls the event (`event.query()`) and,
between polls, checks two things:
- a worker's death: the runner's watchdog thread waits on the workers' process sentinels and sets
  `died` the moment one exits; the wait then raises within a poll, naming the rank (`on_death`);
- the deadline, `timeout_s` (the engine's `distributed_timeout_s`, 300 s by default: the same bound
  NCCL's collectives have), counted from the moment rank 0 starts waiting. It is armed only while
  rank 0 waits for a step it launched: start-up (compiling, capturing CUDA graphs) has its own
  deadline, and a long step (an 8B prefill of 16k tokens takes ~3 s) is far inside it.
Passing the deadline raises `WorkerFailure` naming the bound and the workers, with the ones whose
process is stopped or a zombie called out (`/proc/<pid>/stat`, where there is one).

Polling costs no latency: it spins (yielding the GIL each time) for the first `SPIN_S`, as a
blocking sync does by default, then sleeps a little between polls, longer for long steps.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Protocol

from engine.distributed.worker_faults import WorkerFailure

# Poll without sleeping for this long (decode steps end well within it), then sleep SLEEP_S between
# polls, and LONG_SLEEP_S once the step has run for LONG_S.
SPIN_S, SLEEP_S, LONG_S, LONG_SLEEP_S = 0.05, 1e-4, 1.0, 1e-3


class Pollable(Protocol):
    """A CUDA event (or a stand-in): `query()` is True once the work recorded before it is done."""

    def query(self) -> bool: ...


class Flag(Protocol):
    def is_set(self) -> bool: ...


@dataclass(slots=True)
class StepWait:
    """`timeout_s`: the bound; `died`: set when a worker process exits; `on_death()`: the failure
    naming that worker; `procs`: the workers (rank r at index r - 1), for the deadline's error."""

    timeout_s: float
    died: Flag
    on_death: Callable[[], WorkerFailure]
    procs: Sequence[BaseProcess] = ()

    def wait(self, event: Pollable, what: str = "a step") -> None:
        """Return once `event` is done; raise `WorkerFailure` if a worker dies first or `timeout_s`
        passes."""
        if event.query():
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        while not event.query():
            if self.died.is_set():
                raise self.on_death()
            now = time.monotonic()
            if now >= deadline:
                raise self.overdue(what, now - start)
            waited = now - start
            time.sleep(0 if waited < SPIN_S else SLEEP_S if waited < LONG_S else LONG_SLEEP_S)

    def check(self) -> None:
        """Raise the death's failure if a worker died (a step's event may complete because its
        collectives were aborted, leaving garbage in its outputs)."""
        if self.died.is_set():
            raise self.on_death()

    def overdue(self, what: str, waited_s: float) -> WorkerFailure:
        workers = ", ".join(f"{rank} (pid {p.pid}{_state_note(p.pid)})" for rank, p in enumerate(self.procs, start=1))
        return WorkerFailure(
            f"tensor-parallel engine: {what} did not finish on rank 0's GPU within timeout_s={self.timeout_s} "
            f"(waited {waited_s:.1f} s; distributed_timeout_s sets it): a worker hung, so rank 0's GPU waits in "
            f"the step's all-reduce for a rank that never arrives; workers {workers or 'none'}")


def _state_note(pid: int | None) -> str:
    """', stopped' / ', a zombie' when Linux says so; empty otherwise (or without /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return {"T": ", stopped", "t": ", stopped by a tracer", "Z": ", a zombie", "D": ", in uninterruptible sleep"}.get(
        state, "")
