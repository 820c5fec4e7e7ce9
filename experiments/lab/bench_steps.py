"""`python -m experiments.lab.bench_steps [--eager] [--no-compile] [--greedy] [--reps N]`: wall time of
one `ModelRunner.execute` per step shape (prefill-only, decode-only, mixed), CUDA-synchronised,
median of N after warm-up, on synthetic steps (`experiments.lib.profiling.synthetic`: every sequence
has its own KV blocks) with Qwen3-0.6B shapes and dummy bf16 weights, under nano-vllm's engine
limits (16384 batched tokens, 512 sequences, max_model_len 4096).

The GPU work of these steps is 0.3-8 ms; what the wall time adds to it is host overhead (input
preparation, launches, syncs, sampling). It only uses `ModelRunner`'s public API, so the same
script times an older checkout of the engine (run it from there) for before/after tables.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from engine.config import CacheConfig
from engine.device.model_runner import ModelRunner
from engine.model_loader import load_model_config
from experiments.lib.profiling.synthetic import StepShape, blocks_needed, synthetic_step
from policies.request import SamplingParams

SHAPES = [StepShape(2, 1, 0, 0), StepShape(128, 1, 0, 0), StepShape(512, 1, 0, 0), StepShape(2048, 4, 0, 0),
          StepShape(0, 0, 1, 512), StepShape(0, 0, 64, 1024), StepShape(0, 0, 256, 1024),
          StepShape(16, 1, 64, 1024), StepShape(256, 1, 64, 1024), StepShape(512, 2, 256, 1024)]
BLOCK_SIZE = 16


def _sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def time_step(runner: ModelRunner, shape: StepShape, reps: int, greedy: bool) -> float:
    out = synthetic_step(shape, BLOCK_SIZE, runner.num_gpu_blocks, runner.vocab_size)
    if greedy:
        for s in out.scheduled:
            s.seq.request.sampling_params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    for _ in range(3):
        runner.execute(out)
    _sync(runner)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        runner.execute(out)
        _sync(runner)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--no-compile", action="store_true", help="plain torch elementwise ops")
    ap.add_argument("--greedy", action="store_true", help="temperature 0 (default: 1.0)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--label", default="", help="printed in front of every row")
    ap.add_argument("--model", default="qwen3-0.6b", help="conf/model name (tiny-qwen3 for a CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    cfg = load_model_config(a.model)
    blocks = max(blocks_needed(s, BLOCK_SIZE) for s in SHAPES)
    start = time.perf_counter()
    runner = ModelRunner(cfg, CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=blocks, swap_space=0.5),
                         max_num_batched_tokens=16384, max_num_seqs=512,
                         max_model_len=min(4096, cfg.max_position_embeddings), device=a.device,
                         enforce_eager=a.eager, compile_model=False if a.no_compile else None)
    label = a.label or f"eager={a.eager} compile={not a.no_compile} greedy={a.greedy}"
    print(f"{label}: runner setup {time.perf_counter() - start:.1f} s", flush=True)
    for shape in SHAPES:
        ms = 1e3 * time_step(runner, shape, a.reps, a.greedy)
        fields = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(shape).items())
        print(f"{label} | {fields} | {ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
