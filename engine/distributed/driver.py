"""`TPModelRunner`: rank 0 of a tensor-parallel engine. It is a `ModelRunner` (rank 0's shard, the
sampler, async scheduling's token feedback) that spawns workers 1..N-1 (`engine.distributed.worker`)
and sends them each step before running its own part of it (`engine.distributed.step_message`).

Lifetime: the workers are daemon processes started with `spawn`; `close()` (also run at interpreter
exit) tells them to stop, waits `JOIN_TIMEOUT_S`, kills any that remain and frees rank 0's model
and caches. A worker that dies or hangs makes the next step (or the one running) raise
`WorkerFailure` within `timeout_s` (the collectives' deadline): the error names the rank, its pid,
its exit code and the worker's own error if it reported one; the engine is then closed.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from engine.config import CacheConfig, ModelConfig
from engine.distributed.parallel_state import TPGroup, abort, destroy, init_group, open_store
from engine.distributed.sharding import check_divisible
from engine.distributed.step_message import StepHeader, broadcast_inputs
from engine.input_batch import StepPlan
from engine.model_runner import ModelRunner
from engine.token_feedback import Feedback, Launched
from policies.outputs import SchedulerOutput

JOIN_TIMEOUT_S = 10.0
# Start-up collectives wait this long at least: ranks build, load, compile and capture at their own pace.
STARTUP_TIMEOUT_S = 900.0


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died, hung or failed to start; the engine is closed."""


class TPModelRunner(ModelRunner):
    """Rank 0 of `tensor_parallel_size` ranks on `device` (GPUs `cuda:i` .. `cuda:i+N-1`, or the
    CPU); `timeout_s`: how long a step's collectives wait for a worker before `WorkerFailure`; the
    other arguments are `ModelRunner`'s, given to every rank."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, *, tensor_parallel_size: int,
                 device: str | torch.device = "cpu", timeout_s: float = 300.0, **runner_kwargs: Any) -> None:
        check_divisible(model_config, tensor_parallel_size)
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
        self._links: list[Connection] = []
        self._procs: list[multiprocessing.Process] = []
        self._failure: WorkerFailure | None = None
        self._closed = False
        self._serving = False  # False during start-up: every rank profiles and captures by itself
        self._header = StepHeader()
        self.tp: TPGroup | None = None
        # Stops the workers at interpreter exit (or when the runner is collected) if close() was not called.
        self._group_open: list[bool] = []  # [True] while this runner holds the process's group
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._links, JOIN_TIMEOUT_S,
                                           self._group_open)
        startup_s = max(timeout_s, STARTUP_TIMEOUT_S)
        store = open_store(size, startup_s)
        ctx = multiprocessing.get_context("spawn")
        kwargs = {"model_config": model_config, "cache_config": cache_config, **runner_kwargs}
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_entry, name=f"servelab-tp{rank}", daemon=True,
                               args=(rank, size, store.port, str(devices[rank]), kwargs, startup_s, timeout_s, theirs))
            proc.start()
            theirs.close()
            self._links.append(ours)
            self._procs.append(proc)
        self._store = store
        with self._guard("start-up"):
            self.tp = init_group(store, 0, size, devices[0], startup_s)
            self._group_open.append(True)
            super().__init__(model_config, cache_config, device=devices[0], tp=self.tp, **runner_kwargs)
            for rank, link in enumerate(self._links, start=1):
                self._expect_ready(rank, link, startup_s)
            self.tp.set_timeout(timeout_s)
        self._serving = True
        self._watchdog = threading.Thread(target=_watch, args=(weakref.ref(self), [p.sentinel for p in self._procs]),
                                          name="tp-worker-watchdog", daemon=True)
        self._watchdog.start()

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
            return super().collect(launched)

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
        self._send(header.encode())
        if feedback is not None:  # before the broadcast: the workers get the fed-back tokens with it
            self.feedback.apply(feedback, inputs.input_ids)
        broadcast_inputs(self.batch.buffers, sent, self.tp.device_group)
        return self.forward_inputs(shape, inputs, bool(plan.sampled)), inputs

    def _send(self, data: bytes) -> None:
        for link in self._links:
            link.send_bytes(data)

    # ---- faults and shutdown -----------------------------------------------------------------
    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except WorkerFailure:
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

    def _any_dead(self) -> bool:
        return any(p.exitcode is not None for p in self._procs)

    def _diagnose(self, what: str, error: BaseException) -> WorkerFailure:
        """Which worker failed and how: dead (exit code and its reported error) or not answering."""
        deadline = time.monotonic() + 2.0  # a failing worker may still be on its way out
        while not self._any_dead() and time.monotonic() < deadline:
            wait([p.sentinel for p in self._procs], timeout=0.05)
        for rank, (proc, link) in enumerate(zip(self._procs, self._links), start=1):
            if proc.exitcode is not None:
                reported = _reported_error(link)
                detail = f": {reported}" if reported else ""
                return WorkerFailure(f"tensor-parallel worker {rank} (pid {proc.pid}) died during {what} with "
                                     f"exit code {proc.exitcode}{detail}")
        return WorkerFailure(f"tensor-parallel workers did not answer within timeout_s={self.timeout_s} during "
                             f"{what} (a worker hung or the group failed): {error}")

    @staticmethod
    def _expect_ready(rank: int, link: Connection, timeout_s: float) -> None:
        if not link.poll(timeout_s):
            raise TimeoutError(f"worker {rank} not ready after {timeout_s} s")
        kind, detail = link.recv()
        if kind != "ready":
            raise RuntimeError(f"worker {rank} failed: {detail}")

    def close(self) -> None:
        """Stop the workers (killed if they do not stop), free rank 0's model and KV cache, end the group."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _stop_workers(self._procs, self._links, JOIN_TIMEOUT_S if self._failure is None else 1.0,
                      self._group_open)
        if hasattr(self, "device"):  # ModelRunner got far enough to hold something
            super().close()


def _watch(runner_ref: weakref.ref, sentinels: list) -> None:
    """A worker's death aborts the device group, so a step blocked on it on the GPU ends. Holds the
    runner weakly: an engine dropped without close() is still collected (and its workers stopped)."""
    while True:
        dead = wait(sentinels, timeout=0.5)
        runner = runner_ref()
        if runner is None or runner._closed:
            return
        if dead:
            if runner.tp is not None and runner.device.type == "cuda":
                abort(runner.tp)
            return
        del runner


def _stop_workers(procs: list[multiprocessing.Process], links: list[Connection], grace_s: float,
                  group_open: list[bool]) -> None:
    """Ask every worker to stop, wait `grace_s`, kill the ones still running; end the group."""
    stop = StepHeader(stop=True).encode()
    for link in links:
        with contextlib.suppress(OSError):
            link.send_bytes(stop)
    for proc in procs:
        proc.join(grace_s)
        if proc.exitcode is None:
            proc.kill()
            proc.join(JOIN_TIMEOUT_S)
    for link in links:
        link.close()
    if group_open:
        destroy()
        group_open.clear()


def _reported_error(link: Connection) -> str | None:
    with contextlib.suppress(OSError, EOFError):
        while link.poll(0.2):
            kind, detail = link.recv()
            if kind == "error":
                return str(detail).strip()
    return None


def _worker_entry(*args: Any) -> None:
    from engine.distributed.worker import worker_main

    worker_main(*args)
