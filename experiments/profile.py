"""`python -m experiments.profile model=qwen3-0.6b [overrides]`: measure the engine's step times on
this machine and write the latency profile the simulator's `profiled` model reads
(`experiments/profiles/<gpu>-<model>.csv`, schema in sim/latency/profile_io.py), then calibrate the
roofline model from it (`conf/hardware/<gpu>-calibrated.yaml`, experiments/calibrate.py).

What is timed: `ModelRunner.execute(out)` on synthetic `SchedulerOutput`s (fake sequences with
their own KV blocks, experiments/lib/profiling/synthetic.py): host input preparation, the device
copies, the forward (a CUDA graph of the step's bucket, as in the engine), logits and sampling, and
the sampled tokens' copy back; CUDA-synchronised wall clock, `warmup` untimed runs then the median
of `repeats`, in each of `passes` sweeps over the grid (the sweeps' median: host speed drifts);
decode contexts spread around their mean as a real batch's do (profiling/synthetic.py), and with
`profile_grid.context_ratios` decode-only rows are also measured per ratio of the longest context to
the mean (the batch-shape axis, column `context_ratio`). Decode-only
rows are then the period of a real `LLMEngine` holding that batch (profiling/host.py
`decode_periods`), `host_s = time_s - forward_s`; rows with prefill add the engine's CPU cost around
`execute` (schedule, update, outputs: `host_overheads`, step wall time minus the same step's execute
re-run warm): `time_s = forward_s + host_s`, or with async scheduling the step launched back to back
(`time_s`, the synchronous price kept as `sync_time_s`). Swap rows time `KVCache.apply` moving N
blocks each way. The timing itself: experiments/lib/profiling/measure.py.

    python -m experiments.profile model=qwen3-0.6b            # the GPU profile (minutes: `elapsed_s` in its metadata)
    python -m experiments.profile model=tiny-qwen3 profile_grid=tiny device=cpu out=/tmp/p.csv

`mode=operators` times the engine's operators instead, for every model at once (GEMMs, attention,
elementwise ops, sampler, block copies, graph launch; all-reduce / all-gather over the machine's
GPUs, NCCL's and the engine's symmetric-memory all-reduce paths where the GPUs have them):
experiments/lib/profiling/operators.py and collectives.py, file format in
sim/latency/operator_file.py, docs/operator_profiles.md.

    python -m experiments.profile mode=operators                               # one GPU, ~4 minutes
    python -m experiments.profile mode=operators operator_parts=[collectives]  # N = 2, 4, 8 GPUs
    python -m experiments.profile mode=operators operator_grid=tiny device=cpu operators_dir=/tmp/ops
"""
from __future__ import annotations

import datetime
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments import profile_suffix, tp_suffix
from experiments.lib.cli import config_errors, run_cli
from experiments.lib.config_schema import check_config, hydra_origin
from experiments.lib.paths import REPO_ROOT
from experiments.lib.profiling.grid import ProfileGrid, fit_prefill_pair_s, fit_prefill_tile_s, write_profile
from experiments.lib.profiling.host import admission_time
from experiments.lib.profiling.limits import EngineLimits, check_grid
from experiments.lib.profiling.measure import PIPELINED_SLACK, measure, slower_pipelined
from experiments.lib.profiling.synthetic import blocks_needed
from experiments.lib.profiling.versions import versions
from policies.block_table_width import table_tokens
from sim.latency.file_meta import device_is
from sim.latency.operator_file import SEQUENCE_PARALLEL_META
from sim.latency.prefill_schedule import PrefillSchedule

HARDWARE_DIR = REPO_ROOT / "conf" / "hardware"


def gpu_slug(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200' (a conf/hardware name it contains), else a slug of the name."""
    known = sorted((p.stem for p in HARDWARE_DIR.glob("*.yaml") if "-" not in p.stem), key=len, reverse=True)
    for stem in known:
        if device_is(stem, device_name):  # the rule a run checks the profile's device by
            return stem
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "device"


OPERATOR_PARTS = ("compute", "collectives")


def profile_operators(cfg: DictConfig, command: str) -> list[Path]:
    """Time the operators of `operator_grid` and write one file per part; returns the paths."""
    import json

    import torch

    from engine.config import resolve_device
    from experiments.lib.profiling.collectives import collective_rows
    from experiments.lib.profiling.operator_grid import OperatorGrid
    from experiments.lib.profiling.operators import compute_rows
    from experiments.lib.profiling.sequence_parallel_rows import sequence_parallel_cells
    from sim.latency.operator_file import read_operator_file, write_operator_file
    check_config(cfg, "profile", *hydra_origin())
    device = torch.device(resolve_device(cfg.device))  # 'cpu', 'cuda' or 'cuda:<index>' of this machine
    grid = OperatorGrid.from_dict(OmegaConf.to_container(cfg.operator_grid, resolve=True))
    parts = list(cfg.operator_parts)
    if not parts or any(p not in OPERATOR_PARTS for p in parts):
        raise ValueError(f"operator_parts={parts!r} is invalid: a non-empty list from {list(OPERATOR_PARTS)}")
    dtype_name = cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu = cfg.gpu or gpu_slug(device_name)
    out_dir = Path(cfg.operators_dir) if cfg.operators_dir else REPO_ROOT / "experiments" / "profiles" / "operators"
    meta = {"gpu": gpu, "device": device_name, "dtype": dtype_name, "versions": versions(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "command": command,
            "grid": json.dumps(grid.as_dict(), separators=(",", ":"))}
    log = (lambda msg: print(f"[operators] {msg}", flush=True)) if cfg.progress else (lambda msg: None)
    paths = []
    if "compute" in parts:
        from engine.device.attention import resolve_decode_kernel
        # The decode kernel "auto" picks for a typical shape (head_dim 128, 4 query heads per KV head);
        # the CPU runs the torch references.
        kernels = (resolve_decode_kernel(cfg.decode_kernel, device, dtype, 128, 4, grid.block_size)
                   if device.type == "cuda" else "reference")
        start = time.perf_counter()
        rows = compute_rows(grid, device, dtype, cfg.decode_kernel, cfg.max_model_len, log)
        meta_c = {**meta, "kernels": kernels, "decode_block_table_tokens": table_tokens(cfg.max_model_len, grid.block_size),
                  "elapsed_s": f"{time.perf_counter() - start:.1f}"}
        paths.append(write_operator_file(out_dir / f"{gpu}-{dtype_name}-{kernels}.csv", meta_c, rows))
    if "collectives" in parts:
        start = time.perf_counter()
        cells = sequence_parallel_cells(grid, dtype.itemsize)
        implementations: dict[str, str] = {}
        rows = collective_rows(grid.world_sizes, grid.collective_bytes, dtype, device.type == "cuda", log,
                               width=grid.fused_norm_width, cells=cells, implementations=implementations)
        if rows:
            sizes = "-".join(str(w) for w in sorted({int(r["world_size"]) for r in rows}))
            meta_n = {**meta, "kernels": "collectives", "elapsed_s": f"{time.perf_counter() - start:.1f}"}
            if implementations:  # which sequence-parallel boundaries were timed (the simulator checks)
                meta_n[SEQUENCE_PARALLEL_META] = json.dumps(implementations, separators=(",", ":"))
            paths.append(write_operator_file(out_dir / f"{gpu}-{dtype_name}-collectives-n{sizes}.csv", meta_n, rows))
    for path in paths:
        read_operator_file(path)  # the schema check, before anyone relies on the file
    return paths


def build_runner(cfg: DictConfig, grid: ProfileGrid):
    """A ModelRunner whose KV cache holds the largest grid step and whose swap pool the largest swap
    (the grid already checked against the engine limits: profiling/limits.py)."""
    import torch

    from engine.config import CacheConfig, ModelConfig, RunnerConfig, resolve_device
    from engine.device.model_runner import ModelRunner
    from engine.parallel_config import ParallelConfig
    model = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    bs = cfg.block_size
    shapes = grid.step_shapes() + grid.split_shapes()
    need = max(max(blocks_needed(s, bs) for s in shapes), max(grid.swap_blocks), math.ceil(cfg.max_model_len / bs))
    # decode_periods runs these batches in an engine: their contexts grow a few tokens, and the
    # scheduler keeps a watermark (1%) of the blocks free.
    num_gpu_blocks = math.ceil(need * 1.02) + max(grid.decode_seqs) * (2 + (cfg.warmup + cfg.host_repeats) // bs) + 1
    device = resolve_device(cfg.device)
    dtype = cfg.dtype or (model.dtype if device.startswith("cuda") else "float32")
    block_bytes = bs * model.kv_bytes_per_token_in(getattr(torch, dtype).itemsize)
    swap_gib = (max(grid.swap_blocks) + 1) * block_bytes / 2**30
    cache = CacheConfig(block_size=bs, swap_space=swap_gib * 1.001, num_gpu_blocks=num_gpu_blocks)
    config = RunnerConfig(model, cache, max_num_batched_tokens=cfg.max_num_batched_tokens,
                          max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, dtype=dtype,
                          enforce_eager=cfg.enforce_eager, seed=cfg.seed, decode_kernel=cfg.decode_kernel)
    tp = int(cfg.get("tensor_parallel_size", 1))
    if tp > 1:  # rank 0 of a tensor-parallel group: its steps are the group's
        from engine.distributed.driver import TPModelRunner
        return TPModelRunner(config, ParallelConfig(tp), device)
    return ModelRunner.from_config(config, device)


def prefill_schedule(runner) -> PrefillSchedule:
    """The prefill kernel's program geometry on the runner's device and model (one rank's heads)."""
    from kernels.prefill import program_geometry
    m = runner.local_config
    return PrefillSchedule(*program_geometry(m.num_attention_heads, m.num_key_value_heads, m.head_dim, runner.device))


def profile(cfg: DictConfig, command: str) -> tuple[Path, dict[str, Any]]:
    """Build the runner, measure the grid, write the CSV; returns (path, metadata)."""
    import torch

    from engine.config import resolve_device
    check_config(cfg, "profile", *hydra_origin())
    resolve_device(cfg.device)  # a device this machine lacks is named now, not by torch as the runner builds
    grid = ProfileGrid.from_dict(OmegaConf.to_container(cfg.profile_grid, resolve=True))
    for key in ("warmup", "repeats", "host_repeats", "passes"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < (0 if key == "warmup" else 1):
            raise ValueError(f"{key}={cfg[key]!r} is invalid: must be an integer >= {0 if key == 'warmup' else 1}")
    # Before the runner: a shape over the engine's limits fails (or is timed off the graphs) only
    # after minutes of timing the shapes before it.
    check_grid(grid, EngineLimits(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len,
                                  decode_growth=cfg.warmup + cfg.host_repeats))
    start = time.perf_counter()
    runner = build_runner(cfg, grid)
    setup_s = time.perf_counter() - start
    print(f"[profile] runner ready in {setup_s:.1f}s: {runner.num_gpu_blocks} KV blocks on {runner.device}, "
          f"{len(grid.step_shapes())} step shapes to time", flush=True)
    rows, split, probes = measure(cfg, runner, grid)
    admission_s = admission_time(runner, cfg.host_repeats, cfg.seed)
    ahead = bool(cfg.get("async_scheduling", False))
    pair_s, slope, se = fit_prefill_pair_s([(p, pairs, t) for p, _, pairs, t in split])
    schedule = prefill_schedule(runner)
    tile_s, tile_slope, tile_se = fit_prefill_tile_s([(p, k, t) for p, k, _, t in split], schedule)
    dev = runner.device
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    gpu = cfg.gpu or gpu_slug(device_name)
    meta = {
        "model": cfg.model.name, "block_size": runner.block_size, "device": device_name,
        "dtype": str(runner.dtype).replace("torch.", ""), "versions": versions(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "engine": (f"ModelRunner max_num_batched_tokens={cfg.max_num_batched_tokens} max_num_seqs="
                   f"{cfg.max_num_seqs} max_model_len={cfg.max_model_len} enforce_eager={cfg.enforce_eager} "
                   f"decode_kernel={cfg.decode_kernel}"),
        "decode_kernel": runner.decode_kernel,  # what `decode_kernel` resolved to on this device
        "timing": (f"execute() wall clock, CUDA-synchronised; {cfg.warmup} warm-up runs, median of {cfg.repeats}, "
                   f"in each of {cfg.passes} passes over the grid (the passes' median); decode-only rows: time_s = "
                   f"median period of {cfg.host_repeats} consecutive LLMEngine.step() calls holding that batch, "
                   "host_s = time_s - forward_s; rows with prefill: "
                   + (f"time_s = the step launched {cfg.repeats} times back to back without waiting for its tokens, "
                      "per step (async scheduling's steady state), host_s = time_s - forward_s; decode-only rows "
                      "time_s from an engine scheduling ahead; sync_time_s = each row as the synchronous loop "
                      "pays it (for steps not scheduled ahead)" if ahead else
                      f"host_s = LLMEngine.step() minus its execute() re-run warm on this runner (median of "
                      f"{cfg.host_repeats}), time_s = forward_s + host_s")),
        "async_scheduling": str(ahead).lower(),
        "tensor_parallel_size": str(int(cfg.get("tensor_parallel_size", 1))),
        "prefill_layout": ("one sequence per step, no prefix, sampling one token; the 0/0 row repeats "
                           "the smallest prefill row"),
        "prefill_pair_s": f"{pair_s:.6e}",
        "prefill_pair_fit": (f"slope {slope:.3e} s/pair, standard error {se:.1e}: "
                             f"{'used' if pair_s else 'not significant, 0 used'}"),
        "prefill_schedule": schedule.format(),
        "prefill_tile_s": f"{tile_s:.6e}",
        "prefill_tile_fit": (f"slope {tile_slope:.3e} s/key tile, standard error {tile_se:.1e}: "
                             f"{'used' if tile_s else 'not significant, 0 used'}"),
        "prefill_split_rows": "tokens x seqs: s " + " ".join(f"{p}x{k}:{t:.6f}" for p, k, _, t in split),
        "admission_s": f"{admission_s:.6e}",
        "host_probe_us": " ".join(f"{x:.0f}" for x in probes) + " (cpu_probe_us before each pass and after the last)",
    }
    if ahead:  # a row timed for another shape, or disturbed, shows as slower pipelined than synchronous
        slow = slower_pipelined(rows)
        meta["pipelined_check"] = (f"{len(slow)} rows with time_s > {PIPELINED_SLACK} x sync_time_s"
                                   + "".join(f"; P={r['num_prefill_tokens']} D={r['num_decode_seqs']} "
                                             f"C={r['num_context_tokens']}" for r in slow[:5]))
        if slow:
            print(f"[profile] warning: {meta['pipelined_check']}", flush=True)
    # No `decode_graph_sizes`: the decode rows are engine step periods at D real sequences (host work
    # per sequence included), and between two rows the padded graph's GPU time is nearly flat at
    # small batch, so interpolating in D priced the H200 engine runs better than charging the next
    # graph size (fidelity on an H200: 27 -> 28 and 24 -> 30 of 32 targets in two runs).
    if runner.graphs is not None:
        meta["graph_batch_sizes"] = " ".join(str(s) for s in runner.graphs.sizes)  # for the record only
        meta["token_graph_sizes"] = " ".join(str(s) for s in runner.graphs.token_sizes)  # steps with prefill
    meta["elapsed_s"] = f"{time.perf_counter() - start:.1f} (runner setup {setup_s:.1f})"
    runner.close()  # frees the device; ends the tensor-parallel workers and group
    name = f"{gpu}-{cfg.model.name}{tp_suffix(cfg.get('tensor_parallel_size', 1))}{profile_suffix(ahead)}.csv"
    out = Path(cfg.out) if cfg.out else REPO_ROOT / "experiments" / "profiles" / name
    path = write_profile(out, meta, rows)
    meta["gpu"] = gpu
    return path, meta


@hydra.main(config_path="../conf", config_name="profile", version_base="1.3")
@config_errors
def _main(cfg: DictConfig) -> None:
    command = "python -m experiments.profile " + " ".join(sys.argv[1:])
    if cfg.mode == "operators":
        for path in profile_operators(cfg, command.strip()):
            print(f"operator profile -> {path}")
        return
    if cfg.mode != "steps":
        raise ValueError(f"mode={cfg.mode!r} is invalid: 'steps' (a model's step profile) or 'operators'")
    path, meta = profile(cfg, command.strip())
    steps = sum(1 for line in path.read_text().splitlines() if line.startswith("step,"))
    print(f"profile of {meta['model']} on {meta['device']}: {steps} step rows, prefill_tile_s="
          f"{meta['prefill_tile_s']} ({meta['prefill_schedule']}), prefill_pair_s={meta['prefill_pair_s']}, "
          f"{meta['elapsed_s']}s -> {path}")
    if cfg.calibrate:
        from experiments.lib.profiling.calibration import calibrate_to_file
        hw = HARDWARE_DIR / f"{meta['gpu']}.yaml"
        if not hw.is_file():
            print(f"  no conf/hardware/{meta['gpu']}.yaml to calibrate from: roofline calibration skipped")
            return
        target = Path(cfg.calibrated_out) if cfg.calibrated_out else HARDWARE_DIR / f"{meta['gpu']}-calibrated.yaml"
        report = calibrate_to_file(path, hw, target, command)
        print(report)


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
