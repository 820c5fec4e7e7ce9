"""One run of a workload through a backend, as `python -m experiments.run` makes it: the workload
fed to the config's backend, traces, summary.json and plots written to a directory. The entry points
that make runs (run, ab, fidelity, the benches, the showcase) call `run` here.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from experiments.lib import factory
from experiments.lib.backends import run_backend
from experiments.lib.config_schema import check_config, hydra_origin
from experiments.lib.fleet_metrics import fleet_summary
from experiments.lib.metrics import check_slo, goodput, summarize
from experiments.lib.traces import write_fleet_traces, write_summary, write_traces
from experiments.lib.workloads import Workload
from policies.trace import TraceRecorder


def run(cfg: DictConfig, out_dir: str | Path, label: str | None = None,
        workload: Workload | None = None) -> dict[str, Any]:
    """Run cfg's workload (or the given one) through cfg's backend; write traces, summary and plots
    into out_dir; return the summary dict. An unknown or mistyped config key is a ValueError naming
    its file and key (experiments/lib/config_schema.py)."""
    check_config(cfg, "config", *hydra_origin())
    slo = check_slo(OmegaConf.to_container(cfg.slo, resolve=True))  # before the run, not after it
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wl = workload if workload is not None else factory.workload(cfg)
    recorder = TraceRecorder()
    wall = time.perf_counter()
    with tqdm(total=len(wl), desc=label or "run", unit="req", disable=not cfg.get("progress", True),
              leave=False, dynamic_ncols=True) as bar:
        result = run_backend(cfg, wl, recorder, bar.update)
    wall = time.perf_counter() - wall
    bs = factory.block_size(cfg)
    summary: dict[str, Any] = {"label": label or "run"}
    if result.replica_recorders is None:
        requests, steps, events = write_traces(recorder, out_dir)
        summary.update(summarize(requests, steps, bs, slo))
    else:  # a fleet (docs/fleet.md): traces with a replica column, per-replica metrics
        requests, steps, events = write_fleet_traces(result.replica_recorders, out_dir)
        summary.update(fleet_summary(requests, steps, bs, len(result.replica_recorders), slo,
                                     result.info.get("roles")))
    num_gpus = len(result.replica_recorders or [recorder]) * factory.tensor_parallel_size(cfg)
    summary["num_gpus"] = num_gpus
    summary["goodput_per_gpu"] = goodput(requests, summary["duration_s"], slo, num_gpus)
    summary["run"] = {"backend": cfg.backend.name, "policy": cfg.policy.name,
                      "preemption_mode": cfg.policy.preemption_mode, "blocks": cfg.blocks.kind,
                      "block_size": bs, "model": cfg.model.name, "hardware": cfg.hardware.name,
                      "workload": wl.name, "seed": cfg.seed, "num_steps": result.num_steps,
                      "elapsed_s": result.elapsed_s, "clock": result.clock, "wall_time_s": wall, **result.info}
    predictor = factory.build_predictor(cfg, wl)
    if predictor is not None:
        from experiments.lib.predictors import prediction_error
        summary["output_len_predictor"] = prediction_error(predictor, wl)
    summary["config"] = OmegaConf.to_container(cfg, resolve=True)
    write_summary(summary, out_dir)
    if cfg.get("plots", True):
        from experiments.lib.plots import save_run_plots
        save_run_plots(requests, steps, events, bs, out_dir)
    return summary
