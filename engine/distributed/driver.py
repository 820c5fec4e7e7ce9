"""`TPModelRunner`: rank 0 of a tensor-parallel engine. It is a `ModelRunner` (rank 0's shard, the
sampler, async scheduling's token feedback) that spawns workers 1..N-1 (`engine.distributed.worker`)
and sends them each step before running its own part of it (`engine.distributed.step_message`).

Start-up: every wait of rank 0 on its workers watches their processes
(`engine.distributed.worker_faults`): a worker that dies while starting (an import error, a bad
device, a script without `if __name__ == "__main__":`) raises `WorkerFailure` within seconds, not
at the start-up deadline (`STARTUP_TIMEOUT_S`, for ranks that are alive but slow: building,
loading, compiling, capturing).

Lifetime: the workers are daemon processes started with `spawn`; `close()` (also run when the
runner is collected and at interpreter exit) stops them and ends the group within
`JOIN_TIMEOUT_S`, in a safe order (`engine.distributed.shutdown`). A worker that dies or hangs
makes the next step (or the one running) raise `WorkerFailure` within `timeout_s` (the
collectives' deadline): the error names the rank, its pid, its exit code and the worker's own
error if it reported one; the engine is then closed.

With the symmetric-memory all-reduce on, rank 0 never blocks in a device sync while serving: it polls the step's event with a
deadline and watches the workers' processes (`engine.distributed.step_wait`), since a step's
symmetric-memory all-reduce spins on the GPU until every rank arrives and cannot be aborted. After
such a failure rank 0's GPU may still spin in that kernel (`device_stuck`): nothing that would wait
for the device (freeing memory, the graphs) is waited on, and the process must exit, with
`os._exit` or a signal, to get its GPU back: a process holding such an engine (the engine-core
process included) leaves with `os._exit(1)` at interpreter exit (an `atexit` hook), since the
interpreter's own teardown may wait for that kernel.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from functools import partial
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

from engine.config import RunnerConfig
from engine.device.input_batch import StepPlan
from engine.device.model_runner import ModelRunner
from engine.device.sampler import draw_seed
from engine.device.token_feedback import Feedback, Launched
from engine.distributed.parallel_state import TPGroup, abort, init_group, open_store
from engine.distributed.sharding import check_divisible
from engine.distributed.shutdown import WorkerShutdown
from engine.distributed.step_message import StepHeader, broadcast_inputs
from engine.distributed.step_wait import StepWait
from engine.distributed.worker_faults import (
    WorkerFailure,
    await_workers,
    first_death,
    refuse_in_spawn_bootstrap,
    run_watched,
)
from engine.parallel_config import ParallelConfig
from policies.outputs import SchedulerOutput

logger = logging.getLogger("servelab.engine")
__all__ = ["JOIN_TIMEOUT_S", "STARTUP_TIMEOUT_S", "TPModelRunner", "WorkerFailure"]

# A close (or the finalizer) ends within this; after a failure, within a fraction of it.
JOIN_TIMEOUT_S = 10.0
# Start-up collectives wait this long at least: ranks build, load, compile and capture at their own pace.
STARTUP_TIMEOUT_S = 900.0

class TPModelRunner(ModelRunner):
    """Rank 0 of `parallel.tensor_parallel_size` ranks on `device` (GPUs `cuda:i` .. `cuda:i+N-1`, or
    the CPU); `parallel.timeout_s`: how long a step's collectives wait for a worker before
    `WorkerFailure`, its all-reduce settings choose the paths; `config`: every rank's runner (sent
    to the workers as is, with `parallel`)."""

    def __init__(self, config: RunnerConfig, parallel: ParallelConfig, device: str | torch.device = "cpu") -> None:
        refuse_in_spawn_bootstrap()
        tensor_parallel_size, timeout_s = parallel.tensor_parallel_size, parallel.timeout_s
        check_divisible(config.model_config, tensor_parallel_size)
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size > 1 needs this process's torch.distributed default "
                               "group, but one is already initialized (another tensor-parallel engine still "
                               "open, or torchrun): close that engine first")
        size = tensor_parallel_size
        base = torch.device(device)
        if base.type == "cuda":
            first = base.index if base.index is not None else torch.cuda.current_device()
            if first + size > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={size} is invalid: needs GPUs {first}..{first + size - 1}, "
                                 f"this machine has {torch.cuda.device_count()}")
            devices = [torch.device("cuda", first + r) for r in range(size)]
        else:
            devices = [base] * size
        self.timeout_s = timeout_s
        self._shutdown = WorkerShutdown()
        self._procs, self._links = self._shutdown.procs, self._shutdown.links
        self._failure: WorkerFailure | None = None
        self._worker_died = threading.Event()  # set by the watchdog the moment a worker exits
        # Holds the workers, not the runner: an engine dropped without close() is still collected.
        self._step_wait = StepWait(timeout_s, self._worker_died, partial(_death_in_step, self._procs, self._links),
                                   self._procs)
        self._closed = False
        self._serving = False  # False during start-up: every rank profiles and captures by itself
        self._header = StepHeader()
        self._rank0_device = devices[0]
        self.tp: TPGroup | None = None
        # Ends the workers and the group when the runner is collected or at interpreter exit, if
        # close() was not called (bounded like close()).
        self._finalizer = weakref.finalize(self, self._shutdown.run, JOIN_TIMEOUT_S)
        startup_s = max(timeout_s, STARTUP_TIMEOUT_S)
        store = open_store(size, startup_s)
        ctx = multiprocessing.get_context("spawn")
        with self._guard("start-up"):
            for rank in range(1, size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker_entry, name=f"servelab-tp{rank}", daemon=True,
                                   args=(rank, size, store.port, str(devices[rank]), config, parallel, startup_s,
                                         timeout_s, theirs))
                proc.start()
                theirs.close()
                self._links.append(ours)
                self._procs.append(proc)
            self._store = store
            # A death from here on aborts the device group, so rank 0 leaves a collective it waits in.
            self._watchdog = threading.Thread(target=_watch, args=(weakref.ref(self), [p.sentinel for p in self._procs]),
                                              name="tp-worker-watchdog", daemon=True)
            self._watchdog.start()
            # Every worker is up and about to join (or has died: its error, at once).
            await_workers(self._procs, self._links, "joining", startup_s, "start-up")
            self._shutdown.group_open = True  # from here on any group of this process is this engine's
            self.tp = run_watched(lambda: init_group(store, 0, size, devices[0], startup_s, parallel), self._procs, self._links,
                                  startup_s, "start-up (joining the group)")
            super().__init__(config.model_config, config.cache_config, **config.runner_kwargs(), device=devices[0],
                             tp=self.tp)
            self._shutdown.graphs = self.graphs
            await_workers(self._procs, self._links, "ready", startup_s, "start-up")
            self.tp.set_timeout(timeout_s)
            if self.tp.custom is not None:  # eager launches wait for the GPU, bounded (symmetric_all_reduce.py)
                self.tp.custom.pace = partial(self._step_wait.wait, what="a symmetric-memory all-reduce")
        self._serving = True

    # ---- steps -------------------------------------------------------------------------------
    def launch(self, out: SchedulerOutput, after: Launched | None = None) -> Launched:
        self._check_alive()
        self._header = StepHeader(swap_out=out.swap_out, swap_in=out.swap_in, copy=out.copy)
        with self._guard("a step"):
            if not out.scheduled and (out.swap_out or out.swap_in or out.copy):
                self._send(self._header.encode())
            return super().launch(out, after)

    def collect(self, launched: Launched):
        with self._guard("a step"):
            results = super().collect(launched)
            if self._rank0_device.type == "cuda":  # an aborted collective ends its step with garbage tokens
                self._step_wait.check()
            return results

    def await_event(self, event: torch.cuda.Event) -> None:
        # Only the symmetric-memory kernels can spin for good: NCCL's collectives are bounded by the
        # group's timeout and aborted by the watchdog, so that path keeps the blocking sync.
        if self._serving and self.tp is not None and self.tp.custom is not None:
            self._step_wait.wait(event)
        else:  # start-up (every rank syncs its own profiling step) or NCCL only
            event.synchronize()

    def await_forward(self) -> None:
        if self._serving and self._rank0_device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.await_event(event)
            self._step_wait.check()

    @property
    def device_stuck(self) -> bool:
        """Whether rank 0's GPU may be spinning for good in a symmetric-memory all-reduce of a step
        that a failed worker never joined: then only the process's exit frees it."""
        return self._failure is not None and self.tp is not None and self.tp.custom is not None

    def _forward(self, plan: StepPlan, temperatures: list[float] | None, feedback: Feedback | None = None):
        if not self._serving:  # start-up: every rank profiles the same step itself
            return super()._forward(plan, temperatures, feedback)
        shape = self.graphs.shape_for(plan) if self.graphs is not None else None
        inputs = self._write_inputs(plan, shape, temperatures)
        sent = shape or plan.shape()
        if not sent.fits_in(self.batch.buffers.capacity):
            raise RuntimeError(f"step shape {sent} exceeds the input buffers' {self.batch.buffers.capacity}")
        header = self._header
        header.shape, header.graph, header.max_seqlen_q = sent, shape is not None, max(plan.prefill_lens, default=0)
        header.sample_rows, header.fast_sampling = len(plan.sampled), temperatures is not None
        header.seed = draw_seed(temperatures) if temperatures is not None else 0
        self._send(header.encode())
        if feedback is not None:  # before the broadcast: the workers get the fed-back tokens with it
            self.feedback.apply(feedback, inputs.input_ids)
        broadcast_inputs(self.batch.buffers, sent, self.tp.device_group)
        return self.forward_inputs(shape, inputs, bool(plan.sampled)), inputs

    def sample_fast(self, logits: torch.Tensor, temperatures: torch.Tensor, temperature_list: list[float]) -> torch.Tensor:
        """Rank 0's part of the fast path: its columns' best, exchanged with the workers' (each
        told by the step's header), with the seed the header carried."""
        return self.sample_shard(logits, temperatures, self._header.seed)

    def _send(self, data: bytes) -> None:
        for link in self._links:
            link.send_bytes(data)

    # ---- faults and shutdown -----------------------------------------------------------------
    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except WorkerFailure as e:
            self._failure = self._failure or e
            self.close()
            raise
        except ValueError:  # rank 0's own check (a bad block id, too small a cache): raised as is
            if not self._serving:
                self.close()
            raise
        except Exception as e:
            self._failure = self._failure or self._diagnose(what, e)
            self.close()
            raise self._failure from e

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise RuntimeError("the tensor-parallel engine is closed")

    def _diagnose(self, what: str, error: BaseException) -> WorkerFailure:
        """Which worker failed and how: dead (exit code and its reported error) or not answering."""
        failure = first_death(self._procs, self._links, what, grace_s=2.0)  # it may be on its way out
        return failure or WorkerFailure(f"tensor-parallel workers did not answer within timeout_s={self.timeout_s} "
                                        f"during {what} (a worker hung or the group failed): {error}")

    def close(self) -> None:
        """Stop the workers (killed if they do not stop), end the group, free rank 0's model and KV
        cache: within `JOIN_TIMEOUT_S` (`engine.distributed.shutdown`)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._shutdown.run(JOIN_TIMEOUT_S, failed=self._failure is not None, stuck=self.device_stuck)
        if self.device_stuck:  # a free would wait for the spinning kernel: everything stays until exit
            logger.error("tensor-parallel rank 0's GPU %s may be stuck in an all-reduce that a failed worker never "
                         "joined; it is freed only when this process exits, which it will do with os._exit(1) at "
                         "interpreter exit", self._rank0_device)
            atexit.register(_exit_at_once)
            return
        if hasattr(self, "device"):  # ModelRunner got far enough to hold something
            self.graphs = None  # the shutdown's to free, in bounded time (ModelRunner.close waits for the device)
            super().close()
        if self.tp is not None:  # after the graphs that read it: release the symmetric buffer
            self.tp.custom = None


def _death_in_step(procs: list, links: list) -> WorkerFailure:
    return (first_death(procs, links, "a step", grace_s=2.0)
            or WorkerFailure("a tensor-parallel worker exited during a step"))


def _exit_at_once() -> None:
    """Run first at interpreter exit (registered last): end the process without the rest of the
    teardown, which may wait for the GPU's spinning kernel (the CUDA context's destruction); the
    kernel ends with the process. Exit code 1: a tensor-parallel step failed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _watch(runner_ref: weakref.ref, sentinels: list) -> None:
    """A worker's death aborts the device group, so a step (or a start-up collective) blocked on it
    on the GPU ends. Holds the runner weakly: an engine dropped without close() is still collected
    (and its workers stopped)."""
    while True:
        dead = wait(sentinels, timeout=0.5)
        runner = runner_ref()
        if runner is None or runner._closed:
            return
        if dead:
            runner._worker_died.set()
            # NCCL's kernels leave a collective when the group is aborted; a symmetric-memory
            # all-reduce never does, and an abort queued behind one blocks this thread for good
            # (and with it the interpreter, while the abort holds the GIL): then the step's
            # bounded wait reports the death and the process's exit frees the GPU.
            if runner.tp is not None and runner._rank0_device.type == "cuda" and runner.tp.custom is None:
                abort(runner.tp)
            return
        del runner


def _worker_entry(*args: Any) -> None:
    from engine.distributed.worker import worker_main

    worker_main(*args)
