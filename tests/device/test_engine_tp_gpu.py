"""Tensor parallelism on GPUs (NCCL). The N = 1 smoke test runs rank 0's tensor-parallel path (NCCL
group, sharded model, all-reduces captured in CUDA graphs) on one GPU; the N = 2 tests need two
GPUs and are skipped otherwise: bf16 greedy agreement with one GPU (small all-reduces over
symmetric memory, the default, for the process's first TP engine, and NCCL only, as every later one
of the process), preemption by swap, CUDA graphs on and off, and
closing in bounded time (close(), and a script's interpreter exit)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.distributed import custom_all_reduce
from engine.distributed.driver import JOIN_TIMEOUT_S, TPModelRunner
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from engine.parallel_config import ParallelConfig
from policies.request import SamplingParams

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPTS = [list(range(1, 1 + n)) for n in (5, 40, 130, 300, 17, 64)]
# Small engines (few CUDA-graph buckets to capture: each test builds two, each rank compiles its
# own); a worker that stops answering fails the test within two minutes instead of five.
ARGS = {"model": "qwen3-0.6b", "max_model_len": 1024, "max_num_seqs": 8, "max_num_batched_tokens": 1024,
        "gpu_memory_utilization": 0.5, "distributed_timeout_s": 120.0}


def _generate(engine: LLMEngine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


def _agree(a: list[list[int]], b: list[list[int]], label: str = "") -> float:
    """Fraction of sequences whose first 8 greedy tokens agree (bf16 sums differ in order); prints
    how many agree over all their tokens too (run with -s to see it)."""
    exact = sum(x == y for x, y in zip(a, b))
    first8 = sum(x[:8] == y[:8] for x, y in zip(a, b))
    print(f"\n[agreement] {label}: {exact}/{len(a)} sequences identical over {len(a[0])} tokens, "
          f"{first8}/{len(a)} on their first 8")
    return first8 / len(a)


def test_tp1_nccl_path_matches_the_plain_engine():
    args = EngineArgs(**ARGS)
    with LLMEngine(args) as engine:  # closed: the next engine sizes its KV cache from free memory
        reference = _generate(engine)
    runner = TPModelRunner(args.runner_config(args.model_config(), 1024), ParallelConfig(tensor_parallel_size=1),
                           device="cuda")
    assert runner.graphs is not None and runner.graphs.graphs  # all-reduces captured in the graphs
    engine = LLMEngine(args, runner=runner)
    try:
        assert _agree(_generate(engine), reference) >= 5 / 6
    finally:
        engine.close()


@two_gpus
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_tp2_bf16_greedy_agrees_with_one_gpu(eager):
    with LLMEngine(EngineArgs(**ARGS, enforce_eager=eager)) as engine:
        reference = _generate(engine)
    # The symmetric-memory all-reduce (the default) for the first TP engine of this process; a later
    # one stays on NCCL (torch's rendezvous meets once per process: engine/distributed/custom_all_reduce.py).
    symmetric = not custom_all_reduce._rendezvous_joined
    with LLMEngine(EngineArgs(**ARGS, enforce_eager=eager, tensor_parallel_size=2)) as engine:
        assert engine.runner.num_gpu_blocks > 0
        assert (engine.runner.tp.custom is not None) == symmetric
        assert _agree(_generate(engine), reference, f"N=2 vs N=1, {'eager' if eager else 'CUDA graphs'}") >= 5 / 6


@two_gpus
def test_tp2_nccl_only_agrees_with_one_gpu():
    """`disable_custom_all_reduce=True`: every all-reduce through NCCL, the same tokens."""
    with LLMEngine(EngineArgs(**ARGS)) as engine:
        reference = _generate(engine)
    with LLMEngine(EngineArgs(**ARGS, tensor_parallel_size=2, disable_custom_all_reduce=True)) as engine:
        assert engine.runner.tp.custom is None
        assert _agree(_generate(engine), reference, "N=2 NCCL only vs N=1, CUDA graphs") >= 5 / 6


@two_gpus
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tp2_preemption_keeps_tokens(mode):
    base = {**ARGS, "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2}
    with LLMEngine(EngineArgs(**base)) as engine:
        free = _generate(engine)
    # The six requests end holding 50 blocks of 16 tokens and the longest alone 21. 32 blocks (one
    # max_model_len=512 request, the least the engine accepts) hold the longest request but not the
    # six together, so running sequences are preempted (the same squeeze on the CPU engine preempts
    # 3 times by swap and once by recompute).
    squeezed = {**base, "max_model_len": 512, "num_gpu_blocks": 32, "block_size": 16, "preemption_mode": mode}
    with LLMEngine(EngineArgs(**squeezed)) as engine:
        tokens = _generate(engine)
        preempted = sum(row[f"num_preempted_{mode}"] for row in engine.recorder.steps)
    assert preempted > 0
    assert _agree(tokens, free, f"N=2 with {preempted} preemptions by {mode} vs N=2 unsqueezed") >= 5 / 6


@two_gpus
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_tp2_close_ends_in_bounded_time(eager):
    """The workers leave by themselves (exit code 0, not killed) and the group is gone, within the bound."""
    engine = LLMEngine(EngineArgs(**ARGS, enforce_eager=eager, tensor_parallel_size=2))
    procs = list(engine.runner._procs)
    _generate(engine, PROMPTS[:2])
    start = time.monotonic()
    engine.close()
    took = time.monotonic() - start
    print(f"\n[close] N=2 {'eager' if eager else 'CUDA graphs'}: {took:.2f} s, worker exit codes "
          f"{[p.exitcode for p in procs]}")
    assert took < JOIN_TIMEOUT_S + 2
    assert [p.exitcode for p in procs] == [0]
    assert not dist.is_initialized()


SCRIPT = """
import time
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from policies.request import SamplingParams

if __name__ == "__main__":
    engine = LLMEngine(EngineArgs(**{args!r}, tensor_parallel_size=2))
    engine.add_request("a", list(range(1, 40)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    print("done at", time.time(), flush=True)
    # no close(): the finalizer at interpreter exit ends the workers and the group
"""


@two_gpus
def test_tp2_script_exits_without_close():
    """bench_throughput wrote its result and never exited: a script's exit must end within the bound
    after its last step (start-up, compiling and capturing, is not the point)."""
    root = Path(__file__).resolve().parents[2]
    try:
        res = subprocess.run([sys.executable, "-c", SCRIPT.format(args=ARGS)], cwd=root, capture_output=True,
                             text=True, timeout=300, check=False, env={**os.environ, "PYTHONPATH": str(root)})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script did not exit within 300 s; its output: {e.stdout!r} {e.stderr!r}"[-3000:])
    exited = time.time()
    done = [float(line.split()[-1]) for line in res.stdout.splitlines() if line.startswith("done at")]
    assert res.returncode == 0 and done, res.stderr[-3000:]
    print(f"\n[exit] N=2 script: exited {exited - done[0]:.2f} s after its last step")
    assert exited - done[0] < JOIN_TIMEOUT_S + 20  # the finalizer's bound and the interpreter's own exit
