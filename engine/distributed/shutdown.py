"""Closing a tensor-parallel engine: rank 0's side, in a safe order and in bounded time.

`close()`, the runner's finalizer (an engine dropped without close) and interpreter exit all run
`WorkerShutdown.run`, which ends within `timeout_s` whatever the workers or NCCL do:
1. tell every worker to stop (a worker then frees its CUDA graphs, ends its side of the group with
   the same bounds as here, and leaves with `os._exit`, skipping the interpreter's teardown);
2. free rank 0's CUDA graphs: a graph that captured collectives holds the communicator, and NCCL's
   teardown (abort included) waits until no graph does;
3. end the group: destroy it while the workers destroy theirs, or abort it if that does not return
   in time. After a failure a dead rank never joins a destroy: the abort starts at once, before
   step 2, so that a graph still waiting on the dead rank is let go before it is freed;
4. wait for the workers until the deadline, then kill the ones left.
Steps 2 and 3 run on helper threads that are left behind if they do not return; nothing here waits
without a bound, so an engine's close, its finalizer and the interpreter's exit always end.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from engine.distributed.parallel_state import abort_group, bounded, end_group, in_background
from engine.distributed.step_message import StepHeader

# Of a close's bound: the graphs' release, the group's destroy, then its abort; a killed worker's reaping.
GRAPHS_S, DESTROY_S, ABORT_S, REAP_S = 2.0, 4.0, 2.0, 1.0


@dataclass(slots=True)
class WorkerShutdown:
    """What rank 0 must end, held apart from the runner so its finalizer can end it too."""

    procs: list[BaseProcess] = field(default_factory=list)
    links: list[Connection] = field(default_factory=list)
    graphs: Any = None  # rank 0's `StepGraphs`, once captured
    group_open: bool = False
    done: bool = False

    def run(self, timeout_s: float, failed: bool = False, stuck: bool = False) -> None:
        """Stop the workers, free rank 0's graphs, end the group: all within `timeout_s`. `stuck`:
        rank 0's GPU may spin for good in a symmetric-memory all-reduce that a failed worker never
        joined; the graphs and the group are then left to the process's exit (freeing or aborting
        them would wait behind that kernel, holding the GIL) and only the workers are ended."""
        if self.done:
            return
        self.done = True
        deadline = time.monotonic() + timeout_s
        stop = StepHeader(stop=True).encode()
        for link in self.links:
            with contextlib.suppress(OSError):
                link.send_bytes(stop)
        if stuck:
            self.graphs, self.group_open = None, False
        aborting = in_background(abort_group) if failed and self.group_open else None
        graphs, self.graphs = self.graphs, None
        if graphs is not None:
            bounded(graphs.release, GRAPHS_S)
        if aborting is not None:
            aborting.join(ABORT_S)
        elif self.group_open:
            end_group(DESTROY_S, ABORT_S)
        self.group_open = False
        for proc in self.procs:
            proc.join(max(0.0, deadline - REAP_S - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join(REAP_S)
        for link in self.links:
            link.close()

