"""`python -m experiments.lab.profile_engine_step [overrides] [--steps N]`: where a decode step's time goes.

Loads bench_throughput's nano-vllm requests into the engine, runs until every request is decoding,
then times N steps split into scheduler.schedule / runner.execute (forward + sampling, synchronous:
it returns host tokens) / scheduler.update / the rest of LLMEngine.step, and profiles a few steps
with torch.profiler: the CUDA kernels by total time and the GPU-busy share of the wall time. The
gap between wall time and GPU time is CPU work the GPU waits for. `--advance N` decodes N more steps
first (longer contexts); `--out DIR` writes the per-part breakdown (`kernel_breakdown`: time, least
bytes, achieved bandwidth against the measured copy bandwidth) as markdown and CSV.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.lab.kernel_breakdown import DecodeShape, Kernel, breakdown_rows
from experiments.lib import factory
from experiments.lib.engine_backend import engine_args, get_engine
from experiments.lib.engine_bench import BASE, copy_bandwidth, markdown_table
from experiments.lib.fidelity_spec import compose_cfg


def _timed(obj, name: str, acc: dict[str, float]):
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--advance", type=int, default=0, help="decode steps to run before measuring")
    ap.add_argument("--out", type=Path, default=None, help="write the per-part breakdown here")
    a = ap.parse_args()
    cfg = compose_cfg([*BASE, *a.overrides])
    workload = factory.workload(cfg)
    args = engine_args(cfg)
    bandwidth = copy_bandwidth(torch.device(args.resolve_device())) if torch.cuda.is_available() else 0.0
    engine = get_engine(args)
    for r in workload.requests:
        engine.add_request(r.request_id, r.prompt_token_ids,
                           dataclasses.replace(r.sampling_params, output_kind="final_only"))
    while engine.scheduler.num_waiting or any(s.num_new_tokens > 1 for s in _peek(engine)):
        engine.step()
    for _ in range(5 + a.advance):
        engine.step()
    acc: dict[str, float] = {}
    _timed(engine.scheduler, "schedule", acc)
    _timed(engine.scheduler, "update", acc)
    for name in ("execute", "launch", "collect"):  # execute: synchronous scheduling; launch/collect: async
        _timed(engine.runner, name, acc)
    spans = _gpu_spans(engine.runner) if torch.cuda.is_available() else None
    ctx = sum(s.seq.num_computed_tokens for s in _peek(engine))
    running = engine.scheduler.num_running
    start = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    wall = (time.perf_counter() - start) / a.steps
    print(f"decode steps: {running} running seqs, mean context {ctx / max(running, 1):.0f} tokens")
    phases = " + ".join(f"{name} {t / a.steps * 1e3:.3f}" for name, t in acc.items())
    print(f"per step: wall {wall * 1e3:.2f} ms = {phases} + engine rest "
          f"{(wall - sum(acc.values()) / a.steps) * 1e3:.3f} ms")
    if spans:  # synchronous scheduling only (execute returns host tokens)
        span = sum(s.elapsed_time(e) for s, e in spans) / len(spans)  # ms
        print(f"GPU span per step (first input copy to last kernel, CUDA events): {span:.3f} ms; "
              f"GPU idle between steps: {wall * 1e3 - span:.3f} ms ({100 * (1 - span / (wall * 1e3)):.0f}% of wall)")
        spans.clear()
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(a.profile_steps):
                engine.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / a.profile_steps
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / a.profile_steps / 1e3
        print(f"profiled: wall {wall * 1e3:.2f} ms/step, GPU kernels {gpu:.2f} ms/step "
              f"({100 * gpu / (wall * 1e3):.0f}% busy)")
        print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
        if a.out is not None:
            seqs = _peek(engine)
            shape = DecodeShape(len(seqs), sum(s.seq.num_computed_tokens + 1 for s in seqs))
            write_breakdown(a.out, _kernels(prof), a.profile_steps, engine, shape, bandwidth, wall)


def _kernels(prof) -> list[Kernel]:
    """The profiled CUDA kernels (not copies or memsets), by start time."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if e.device_type() != DeviceType.CUDA or name.startswith(("Memcpy", "Memset")):
            continue
        out.append(Kernel(name, e.start_ns() / 1e3, e.duration_ns() / 1e3))
    return sorted(out, key=lambda k: k.start_us)


def write_breakdown(out: Path, kernels: list[Kernel], steps: int, engine, shape: DecodeShape,
                    bandwidth: float, wall_s: float) -> None:
    rows = pd.DataFrame(breakdown_rows(kernels, steps, engine.model_config, shape, bandwidth))
    device = torch.cuda.get_device_name()
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"step_kernels_{engine.runner.decode_kernel}_{dt.datetime.now(dt.UTC):%Y-%m-%dT%H%M}"
    rows.to_csv(f"{stem}.csv", index=False)
    head = (f"# Decode step kernels ({device}, {now})\n\n{shape.rows} sequences decoding, {shape.context_tokens} "
            f"context tokens (mean {shape.context_tokens / max(shape.rows, 1):.0f}); decode kernel "
            f"`{engine.runner.decode_kernel}`; wall {wall_s * 1e3:.2f} ms per profiled step; copy bandwidth "
            f"{bandwidth / 1e12:.2f} TB/s. Least bytes: weights once, activations in and out once, K/V of "
            "every context token once.\n\n")
    table = markdown_table(rows)
    Path(f"{stem}.md").write_text(head + table + "\n")
    print(head + table)


def _gpu_spans(runner) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    """Records a CUDA event before each step's inputs are enqueued and one after `execute` returns
    (its token read has synchronised): the pair spans the step's GPU work, the rest of the wall
    time is host work the GPU waits for. A step without a forward records nothing."""
    spans, started = [], []
    forward, execute = runner._forward, runner.execute

    def timed_forward(*args, **kwargs):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        started.append(start)
        return forward(*args, **kwargs)

    def timed_execute(*args, **kwargs):
        out = execute(*args, **kwargs)
        if started:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            spans.append((started.pop(), end))
        return out
    runner._forward, runner.execute = timed_forward, timed_execute
    return spans


def _peek(engine):
    """The running sequences as the next step would see them (decode entries of the scheduler)."""
    from policies.outputs import ScheduledSeq
    return [ScheduledSeq(s, len(s.token_ids) - s.num_computed_tokens, 1) for s in engine.scheduler.queues.running]


if __name__ == "__main__":
    main()
