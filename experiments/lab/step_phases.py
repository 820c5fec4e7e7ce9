"""Where a decode step's wall time goes, window by window:
`python -m experiments.lab.step_phases [--model qwen3-0.6b] [--decodes 16] [--builds 2] [--windows 4]`.

For each of `builds` fresh runners (allocations, CUDA-graph capture) it replays one synthetic
decode step (`--decodes` sequences at `--context` tokens) in `windows` one-second-apart windows and
prints the median of each phase: host planning (`BatchBuilder.plan`, temperatures), input writes
plus graph launch (`ModelRunner._forward`), sampling launch, the wait for the GPU (`tolist`), and
the total; on a GPU also the CUDA-graph replay's own time from CUDA events. A host phase that
changes between windows while the replay time does not is host CPU speed (docs/history.md:
up to 2.5x on the device VMs).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.config import CacheConfig
from engine.device.model_runner import ModelRunner
from engine.device.sampler import sample_with_temperatures
from engine.model_loader import load_model_config
from experiments.lib.profiling.synthetic import StepShape, synthetic_step

PHASES = ("plan", "write+launch", "sample-launch", "wait", "total")


def phase_times(runner: ModelRunner, out) -> tuple[float, ...]:
    """Seconds of each of PHASES for one execute of `out`, as ModelRunner.execute runs it."""
    t0 = time.perf_counter()
    plan = runner.batch.plan(out.scheduled)
    temps = runner.sampler.fast_temperatures(plan.sampled)
    t1 = time.perf_counter()
    logits, inputs = runner._forward(plan, temps)
    t2 = time.perf_counter()
    rows = len(plan.sampled)
    tokens = sample_with_temperatures(logits[:rows], inputs.temperatures[:rows], temps)
    t3 = time.perf_counter()
    tokens.tolist()
    t4 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0


def replay_ms(runner: ModelRunner, out, steps: int) -> float | None:
    """Median GPU time of the CUDA graph the engine runs `out` in (None without one)."""
    shape = runner.graphs.shape_for(runner.batch.plan(out.scheduled)) if runner.graphs is not None else None
    if shape is None:
        return None
    graph = runner.graphs.graphs[shape]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(model: str, decodes: int, context: int, builds: int, windows: int, steps: int, pause_s: float,
        device: str) -> list[dict]:
    rows = []
    config = load_model_config(model)
    max_len = min(config.max_position_embeddings, max(4096, 2 * context))
    blocks = max(2 * decodes * (context + 16) // 16 + 64, max_len // 16 + 1)
    for b in range(builds):
        runner = ModelRunner(config, CacheConfig(block_size=16, num_gpu_blocks=blocks, swap_space=0),
                             max_num_batched_tokens=max(512, decodes), max_num_seqs=max(32, decodes),
                             max_model_len=max_len, device=device, seed=0)
        out = synthetic_step(StepShape(0, 0, decodes, context), 16, runner.num_gpu_blocks, runner.vocab_size)
        for _ in range(5):
            runner.execute(out)
        for w in range(windows):
            samples = [phase_times(runner, out) for _ in range(steps)]
            row = {"build": b, "window": w}
            row.update({p: statistics.median(c) * 1e6 for p, c in zip(PHASES, zip(*samples))})
            row["replay_gpu"] = (replay_ms(runner, out, steps) or 0.0) * 1e3
            rows.append(row)
            print(f"build {b} window {w} (us): " + " ".join(f"{k} {row[k]:.0f}" for k in (*PHASES, "replay_gpu")),
                  flush=True)
            time.sleep(pause_s)
        del runner, out
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--decodes", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--builds", type=int, default=2)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300, help="steps timed per window")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between windows")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    for name in ("decodes", "context", "builds", "windows", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} is invalid: must be >= 1")
    run(args.model, args.decodes, args.context, args.builds, args.windows, args.steps, args.pause, args.device)


if __name__ == "__main__":
    main()
