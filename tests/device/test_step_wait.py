"""Rank 0's bounded wait for a step (engine/distributed/step_wait.py), on CPU with stand-in events:
a step that never finishes raises `WorkerFailure` within the bound naming the workers, a worker's
death ends the wait at once naming the rank, a slow step that finishes is waited for; and the
tensor-parallel runner's wait (gloo, a real worker killed) raises the death's failure."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from engine.distributed.step_wait import SPIN_S, StepWait
from engine.distributed.worker_faults import WorkerFailure
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine


class Never:
    def query(self) -> bool:
        return False


class DoneAt:
    """An event that completes `after_s` seconds from now."""

    def __init__(self, after_s: float) -> None:
        self.at = time.monotonic() + after_s

    def query(self) -> bool:
        return time.monotonic() >= self.at


def _no_death() -> WorkerFailure:
    raise AssertionError("no worker died")


def test_a_step_that_never_finishes_fails_within_the_bound_naming_the_workers():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        time.sleep(0.05)
        wait = StepWait(0.3, threading.Event(), _no_death, [SimpleNamespace(pid=sleeper.pid)])
        start = time.monotonic()
        with pytest.raises(WorkerFailure) as info:
            wait.wait(Never())
        took = time.monotonic() - start
    finally:
        sleeper.kill()
        sleeper.wait()
    assert 0.3 <= took < 1.5
    message = str(info.value)
    assert "within timeout_s=0.3" in message and "distributed_timeout_s" in message
    assert f"workers 1 (pid {sleeper.pid}, stopped)" in message


def test_a_worker_death_ends_the_wait_at_once_naming_the_rank():
    died = threading.Event()
    threading.Timer(0.1, died.set).start()
    wait = StepWait(60.0, died, lambda: WorkerFailure("tensor-parallel worker 1 (pid 7) died during a step"))
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"worker 1 \(pid 7\) died"):
        wait.wait(Never())
    assert time.monotonic() - start < 2.0  # not the 60 s bound


@pytest.mark.parametrize("after_s", [0.0, SPIN_S / 2, 0.4])
def test_a_slow_step_that_finishes_is_waited_for(after_s):
    """Within the spin, and past it (sleeping between polls): no failure, no return before the event."""
    event = DoneAt(after_s)
    StepWait(1.0, threading.Event(), _no_death).wait(event)
    assert event.query()


def test_check_raises_after_a_death_even_when_the_event_completed():
    died = threading.Event()
    wait = StepWait(1.0, died, lambda: WorkerFailure("worker 1 died"))
    wait.check()
    died.set()
    wait.wait(DoneAt(0.0))  # a completed event returns: the death is the caller's check
    with pytest.raises(WorkerFailure, match="worker 1 died"):
        wait.check()


def test_the_runner_wait_raises_when_its_worker_is_killed():
    """The real watchdog (process sentinels) and death report behind `TPModelRunner.await_event`:
    a worker killed while rank 0 waits on a step that never finishes (a spinning all-reduce)."""
    engine = LLMEngine(EngineArgs(model="tiny-llama", num_gpu_blocks=64, max_model_len=128, swap_space=0.01,
                                  tensor_parallel_size=2, distributed_timeout_s=60.0))
    runner = engine.runner
    (worker,) = runner._procs
    runner.tp.custom = object()  # as if every rank had opened the symmetric buffer: the polled wait
    try:
        threading.Timer(0.2, os.kill, (worker.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(WorkerFailure) as info:
            runner.await_event(Never())
        assert time.monotonic() - start < 10.0  # not the 60 s bound
        assert f"worker 1 (pid {worker.pid}) died during a step with exit code -9" in str(info.value)
    finally:
        runner.tp.custom = None
        engine.close()
    assert worker.exitcode is not None


def test_after_a_failure_with_symmetric_memory_close_frees_nothing_and_exits_at_once(monkeypatch):
    """Rank 0's GPU may still spin in the all-reduce (a free or an abort would wait for it): close
    stops the workers, keeps the model, KV cache, symmetric buffer and group, and registers
    `os._exit(1)` for the interpreter's exit (stood in for here: on CPU gloo carries the all-reduces)."""
    from engine.distributed import driver

    registered = []
    monkeypatch.setattr(driver.atexit, "register", registered.append)
    engine = LLMEngine(EngineArgs(model="tiny-llama", num_gpu_blocks=64, max_model_len=128, swap_space=0.01,
                                  tensor_parallel_size=2))
    runner = engine.runner
    (worker,) = runner._procs
    buffer = object()
    runner.tp.custom = buffer  # as if every rank had opened the symmetric buffer
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(WorkerFailure, match="worker 1"):
        runner.await_event(Never())
    runner._failure = WorkerFailure("worker 1 died")  # what the step's guard records before closing
    assert runner.device_stuck
    engine.close()
    assert runner.model is not None and runner.kv_cache is not None and runner.tp.custom is buffer
    assert registered == [driver._exit_at_once]
    assert worker.exitcode is not None
    assert dist.is_initialized()  # left to the process's exit with the rest
    dist.destroy_process_group()  # gloo's ends at once: the next test's engine can start


def test_an_nccl_only_runner_keeps_the_blocking_sync():
    """Without the symmetric buffer no kernel can spin for good (NCCL's collectives have the
    group's timeout and the watchdog's abort), so the event is synchronized, not polled."""
    engine = LLMEngine(EngineArgs(model="tiny-llama", num_gpu_blocks=64, max_model_len=128, swap_space=0.01,
                                  tensor_parallel_size=2))
    synced = []

    class Event:
        def query(self):
            raise AssertionError("polled")

        def synchronize(self):
            synced.append(True)

    try:
        assert engine.runner.tp.custom is None
        engine.runner.await_event(Event())
    finally:
        engine.close()
    assert synced == [True]
