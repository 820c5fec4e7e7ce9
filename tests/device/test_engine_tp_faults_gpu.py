"""A tensor-parallel worker that fails in the middle of generation on GPUs, with the symmetric-memory
all-reduce on (the default): its kernels spin until every rank arrives and cannot be aborted, so
these check that rank 0's wait is bounded all the same (engine/distributed/step_wait.py) and that
the process holding the stuck GPU still exits.

Each case runs in its own process (a GPU left spinning must not take the next test's engine with
it), bounded by `subprocess.run(timeout=...)`:
- offline, worker SIGKILLed: `step()` raises `WorkerFailure` naming rank 1 and its exit code within
  seconds; worker SIGSTOPped: within `distributed_timeout_s` (10 s here), naming the stopped rank;
  either way the worker is gone, and the process's exit is prompt: the script's own `os._exit`,
  or the interpreter's exit, cut short by the runner's hook (`os._exit(1)`);
- the engine in its own process (the server's mode): every open stream ends with the failure,
  `check_health` raises it, and the core process exits with code 1 (`os._exit`, not a hang in the
  interpreter's teardown), so the fleet's replica supervision sees a dead replica."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0
# Eager (no compile, no graph capture: a quick start); the eager decode's all-reduces take the same
# one-shot kernel as a replayed graph's.
ARGS = {"model": "qwen3-0.6b", "max_model_len": 1024, "max_num_seqs": 8, "max_num_batched_tokens": 1024,
        "gpu_memory_utilization": 0.5, "enforce_eager": True, "tensor_parallel_size": 2,
        "distributed_timeout_s": TIMEOUT_S}  # the symmetric-memory all-reduce: the default

OFFLINE = """
import json, os, signal, sys, threading, time
from engine.distributed.driver import WorkerFailure
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from policies.request import SamplingParams

if __name__ == "__main__":
    how = sys.argv[1]
    print("phase: engine starting", file=sys.stderr, flush=True)
    engine = LLMEngine(EngineArgs(**{args!r}))
    print("phase: engine up", file=sys.stderr, flush=True)
    runner = engine.runner
    assert runner.tp.custom is not None, "the symmetric-memory all-reduce is off"
    (worker,) = runner._procs
    for i in range(8):
        engine.add_request(f"r{{i}}", list(range(1, 20 + i)),
                           SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
    for _ in range(5):
        engine.step()
    faulted = []
    def fault():
        faulted.append(time.monotonic())
        os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    threading.Timer(0.2, fault).start()
    print("phase: generating, fault in 0.2 s", file=sys.stderr, flush=True)
    result = {{"error": None}}
    try:
        while engine.has_unfinished_requests():
            engine.step()
    except WorkerFailure as e:
        result = {{"error": str(e), "after_fault_s": time.monotonic() - faulted[0]}}
    result.update(stuck=runner.device_stuck, worker_pid=worker.pid, worker_exitcode=worker.exitcode, at=time.time())
    print("RESULT " + json.dumps(result), flush=True)
    if sys.argv[2] == "os._exit":
        os._exit(0)
    # else the interpreter's exit: the runner's atexit hook leaves with os._exit(1)
"""

CORE = """
import asyncio, json, os, signal, sys, time
from engine.engine_args import EngineArgs
from engine.online.async_llm_engine import AsyncLLMEngine
from policies.request import SamplingParams

async def stream(engine, i):
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    try:
        async for _ in engine.generate(list(range(1, 20 + i)), params, f"r{{i}}"):
            pass
    except Exception as e:
        return f"{{type(e).__name__}}: {{e}}"
    return None

async def main():
    print("phase: engine starting", file=sys.stderr, flush=True)
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(**{args!r}), engine_process=True)
    print("phase: engine up", file=sys.stderr, flush=True)
    core = engine._core.process
    with open(f"/proc/{{core.pid}}/task/{{core.pid}}/children") as f:
        (worker,) = [int(p) for p in f.read().split()]
    tasks = [asyncio.create_task(stream(engine, i)) for i in range(8)]
    await asyncio.sleep(2.0)
    faulted = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    print("phase: worker killed", file=sys.stderr, flush=True)
    errors = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    ended = time.monotonic() - faulted
    try:
        await engine.check_health()
        health = None
    except Exception as e:
        health = f"{{type(e).__name__}}: {{e}}"
    core.join(30)
    result = {{"errors": errors, "after_fault_s": ended, "health": health, "core_exitcode": core.exitcode,
               "core_exit_s": time.monotonic() - faulted}}
    print("RESULT " + json.dumps(result), flush=True)
    await engine.shutdown()

if __name__ == "__main__":
    asyncio.run(main())
"""


def _run(script: str, *argv: str, timeout_s: float = 150, args: dict | None = None) -> tuple[dict, float, int]:
    """One case in its own process; a timeout's failure carries the script's stderr, whose last
    `phase:` line says how far it got."""
    try:
        res = subprocess.run([sys.executable, "-c", script.format(args=args or ARGS), *argv], cwd=ROOT, capture_output=True,
                             text=True, timeout=timeout_s, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script did not end within {timeout_s} s (a wait without a bound?): "
                    f"{e.stdout!r} {e.stderr!r}"[-4000:])
    exited = time.time()
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"exit code {res.returncode}; {res.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"\n[fault] {argv or 'engine process'}: {result}")
    return result, exited, res.returncode


@pytest.mark.parametrize(("how", "ending", "kernel"), [
    ("killed", "interpreter-exit", "torch"), ("stopped", "os._exit", "torch"),
    ("stopped", "os._exit", "triton_fused"),  # the Triton kernels spin alike (kernels/all_reduce.py)
    ("stopped", "os._exit", "triton_lamport"),  # and so does the Lamport kernel's polling
])
def test_a_failed_worker_ends_rank0s_step_in_bounded_time(how, ending, kernel):
    result, exited, returncode = _run(OFFLINE, how, ending, args={**ARGS, "all_reduce_kernel": kernel})
    error = result["error"]
    assert error is not None, "generation finished before the fault"
    pid = result["worker_pid"]
    if how == "killed":
        assert f"worker 1 (pid {pid}) died" in error and "exit code -9" in error
        assert result["after_fault_s"] < 15  # the death seen at once, then the bounded close
    else:
        assert f"within timeout_s={TIMEOUT_S}" in error and f"1 (pid {pid}, stopped)" in error
        assert TIMEOUT_S - 1 < result["after_fault_s"] < TIMEOUT_S + 15
    assert result["stuck"] is True and result["worker_exitcode"] is not None  # the stopped one killed
    assert exited - result["at"] < 10  # leaving with the GPU still spinning does not hang
    assert returncode == (0 if ending == "os._exit" else 1)


def test_a_killed_worker_ends_every_stream_and_the_core_process():
    result, _, _ = _run(CORE)
    assert len(result["errors"]) == 8 and all(e and "worker 1" in e for e in result["errors"]), result["errors"]
    assert result["after_fault_s"] < 20
    assert result["health"] and "worker 1" in result["health"]
    assert result["core_exitcode"] == 1 and result["core_exit_s"] < 30
