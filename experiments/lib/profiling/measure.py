"""Timing the profile grid on a runner: the step rows, split rows and swap rows that
`experiments.profile` writes (schema in sim/latency/profile_io.py).

Every shape is timed in each of `passes` sweeps over the grid and the sweeps' median kept: the host
share of a small step moves with the host CPU's speed, which on a shared VM drifts over seconds
(docs/history.md), so one burst per shape would sample one moment. A row's time is then:
- decode-only: the period of a real `LLMEngine` holding that batch (profiling/host.py
  `decode_periods`; with async scheduling, an engine scheduling ahead);
- with prefill, synchronous: `forward_s` (the `execute` median) plus the engine's CPU cost around it
  (`host_overheads`);
- with prefill, async scheduling: the row's own step launched back to back without waiting for its
  tokens (`pipelined_period`), the synchronous price kept as `sync_time_s`.
"""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig
from tqdm import tqdm

from experiments.lib.profiling.grid import ProfileGrid
from experiments.lib.profiling.host import cpu_probe_us, decode_periods, host_overheads, pipelined_period
from experiments.lib.profiling.synthetic import StepShape, swap_mapping, synthetic_step
from sim.latency.profile_io import RATIO_COLUMN


def median_timer(device) -> Callable[[Callable[[], Any], int, int], float]:
    import torch
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def median_time(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            fn()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return median_time


def measure(cfg: DictConfig, runner, grid: ProfileGrid
            ) -> tuple[list[dict], list[tuple[int, int, int, float]], list[float]]:
    """Step rows (forward_s + host_s), swap rows, the split rows (tokens, sequences, pairs, seconds),
    and the host CPU gauge (`cpu_probe_us`) before each pass and after the last."""
    median_time = median_timer(runner.device)
    bs, n_gpu = runner.block_size, runner.num_gpu_blocks
    passes: dict[tuple, list[float]] = {}  # (P, prefill seqs, D, C, ratio) -> execute times
    host_passes: dict[tuple[int, int], list[float]] = {}
    period_passes: dict[tuple, list[float]] = {}  # (D, C, ratio) -> decode periods
    piped: dict[tuple, list[float]] = {}  # async: steps with prefill, pipelined
    ahead_passes: dict[tuple, list[float]] = {}  # async: decode periods
    ahead = bool(cfg.get("async_scheduling", False))
    shapes = grid.step_shapes() + [s for s in grid.split_shapes() if s.num_prefill_seqs > 1]
    outs = [synthetic_step(shape, bs, n_gpu, runner.vocab_size, seed=cfg.seed) for shape in shapes]
    pairs = [(p, d) for p in grid.prefill_tokens if p for d in grid.decode_seqs]  # decode-only rows: periods
    decodes = [(s.num_decode_seqs, s.context_per_decode, s.context_ratio) for s in grid.step_shapes()
               if s.num_prefill_tokens == 0]
    start = time.perf_counter()
    probes = []
    for sweep in range(cfg.passes):
        probes.append(cpu_probe_us())
        done_p = None
        for shape, out in tqdm(list(zip(shapes, outs)), desc=f"steps {sweep + 1}/{cfg.passes}", unit="shape",
                               disable=not cfg.progress, dynamic_ncols=True):
            if shape.num_prefill_tokens != done_p and not cfg.progress:  # a line per prefill plane (logs)
                done_p = shape.num_prefill_tokens
                print(f"[profile] pass {sweep + 1}/{cfg.passes} prefill={done_p}: "
                      f"{time.perf_counter() - start:.1f}s", flush=True)
            key = _key(shape)
            passes.setdefault(key, []).append(
                median_time(functools.partial(runner.execute, out), cfg.warmup, cfg.repeats))
            if ahead and shape.num_prefill_tokens:
                piped.setdefault(key, []).append(pipelined_period(runner, out, cfg.warmup, cfg.repeats))
        for pair, h in host_overheads(runner, pairs, cfg.warmup, cfg.host_repeats, cfg.seed + sweep).items():
            host_passes.setdefault(pair, []).append(h)
        for shape, t in decode_periods(runner, decodes, cfg.warmup, cfg.host_repeats, cfg.seed + sweep).items():
            period_passes.setdefault(shape, []).append(t)
        if ahead:  # the same decode batches, each step scheduled while the one before it runs
            for shape, t in decode_periods(runner, decodes, cfg.warmup, cfg.host_repeats, cfg.seed + sweep,
                                           async_scheduling=True).items():
                ahead_passes.setdefault(shape, []).append(t)
    probes.append(cpu_probe_us())
    print(f"[profile] {len(shapes)} step shapes x {cfg.passes} passes in {time.perf_counter() - start:.1f}s",
          flush=True)
    medians = {name: {k: statistics.median(v) for k, v in d.items()} for name, d in
               (("forward", passes), ("host", host_passes), ("period", period_passes), ("pipelined", piped),
                ("ahead_period", ahead_passes))}
    rows = step_rows(grid.step_shapes(), ahead, **medians)
    split = [(s.num_prefill_tokens, s.num_prefill_seqs, s.prefill_attention_pairs, medians["forward"][_key(s)])
             for s in grid.split_shapes()]
    kv = runner.kv_cache
    for n in grid.swap_blocks:
        mapping = swap_mapping(n, n_gpu, runner.num_cpu_blocks)
        back = {c: g for g, c in mapping.items()}
        for fn in (functools.partial(kv.apply, mapping, {}, []), functools.partial(kv.apply, {}, back, [])):
            rows.append({"kind": "swap", "num_blocks": n, "time_s": median_time(fn, cfg.warmup, cfg.repeats)})
    return rows, split, probes


def _key(s: StepShape) -> tuple[int, int, int, int, float | None]:
    """A shape's timing key; [2:] is its decode part (D, C, ratio), the key of a decode period."""
    return s.num_prefill_tokens, s.num_prefill_seqs, s.num_decode_seqs, s.context_per_decode, s.context_ratio


def step_rows(shapes: list[StepShape], ahead: bool, forward: dict, host: dict, period: dict, pipelined: dict,
              ahead_period: dict) -> list[dict]:
    """The profile's step rows from the per-pass medians, each row priced from its own shape's
    timings (`_key`), then the (0 prefill, 0 decode) corner."""
    rows = []
    for s in shapes:
        key = _key(s)
        f = forward[key]
        if s.num_prefill_tokens == 0:  # decode-only: the engine's own step period (profiling/host.py)
            sync_t = period[key[2:]]
            t = ahead_period[key[2:]] if ahead else sync_t
        else:
            # a measured overhead near zero can come out negative (timing noise): a step is never
            # faster than its forward pass
            sync_t = f + max(0.0, host[(s.num_prefill_tokens, s.num_decode_seqs)])
            t = pipelined[key] if ahead else sync_t  # async: the pipelined period (host work overlapped)
        rows.append({"kind": "step", "num_prefill_tokens": s.num_prefill_tokens,
                     "num_decode_seqs": s.num_decode_seqs, "num_context_tokens": s.num_context_tokens,
                     RATIO_COLUMN: s.context_ratio, "time_s": t, "forward_s": f, "host_s": t - f}
                    | ({"sync_time_s": sync_t} if ahead else {}))
    # The grid needs a (0 prefill, 0 decode) corner although no step is empty: it repeats the
    # smallest prefill's time, so tiny prefill chunks are priced like it (launch-bound), not less.
    smallest = next((r for r in rows if r["num_decode_seqs"] == 0), None)
    if smallest is not None:
        rows.insert(0, smallest | {"num_prefill_tokens": 0})
    return rows


# Overlapping the host's work with the device's can only shorten a step: an async row whose
# pipelined period exceeds its synchronous price by more than this (the two are timed minutes apart,
# the host's speed drifting) was timed for another shape or under a disturbance.
PIPELINED_SLACK = 1.15


def slower_pipelined(rows: list[dict]) -> list[dict]:
    """The pipelined step rows of an async profile (those with prefill and the 0/0 corner that
    repeats one; float rows of `measure` or string rows of a read profile) whose `time_s` exceeds
    PIPELINED_SLACK x their `sync_time_s`."""
    return [r for r in rows if r.get("kind") == "step" and str(r.get("sync_time_s") or "").strip()
            and (int(r["num_prefill_tokens"]) > 0 or int(r["num_decode_seqs"]) == 0)
            and float(r["time_s"]) > PIPELINED_SLACK * float(r["sync_time_s"])]
