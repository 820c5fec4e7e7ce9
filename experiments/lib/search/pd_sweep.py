"""Goodput per GPU of prefill/decode splits against co-located replicas over a sweep of TPOT SLOs
(DistServe's comparison), each point a capacity search (runner.py) of the same space.

For each `tpot_s` of the sweep, every deployment of `search.space` gets its capacity: the highest
request rate at which `search.slo.goodput` of the requests meet both `search.slo.ttft_s` and that
TPOT; divided by its GPUs, that is its goodput per GPU. `crossovers` names, between two successive
TPOT values, where the best deployment changes from a P:D split to a mixed one (or back).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from experiments.lib.search.runner import run_search

SWEEP_COLUMNS = ["tpot_ms", "pd_split", "replicas", "tensor_parallel_size", "num_gpus", "capacity_rps",
                 "capacity_per_gpu_rps", "ttft_p", "tpot_p", "goodput_fraction", "capacity_status", "failed_rps",
                 "failed_because"]


def check_sweep(values: object) -> list[float]:
    if not isinstance(values, list) or not values or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in values):
        raise ValueError(f"sweep.tpot_s={values!r} is invalid: a non-empty list of TPOT SLOs in seconds > 0")
    return sorted(float(v) for v in values)


def pd_sweep(cfg: DictConfig, out_dir: str | Path, progress: bool = True) -> pd.DataFrame:
    """One row per (TPOT SLO, deployment) with its capacity and capacity per GPU."""
    tpots = check_sweep(OmegaConf.to_container(cfg.sweep.tpot_s, resolve=True) if "sweep" in cfg else None)
    base = cfg.copy()
    OmegaConf.set_struct(base, False)
    base.pop("sweep")
    frames = []
    for tpot in tpots:
        point = base.copy()
        point.search.slo.tpot_s = tpot
        result = run_search(point, Path(out_dir) / f"tpot_{tpot * 1e3:g}ms", progress)
        table = result.table[result.table["status"] != "pruned"].copy()
        table["tpot_ms"] = tpot * 1e3
        frames.append(table)
    return pd.concat(frames, ignore_index=True)[SWEEP_COLUMNS]


def best_per_tpot(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per TPOT SLO: the best mixed and the best split deployment's goodput per GPU, and the winner."""
    rows = []
    for tpot, group in sweep.groupby("tpot_ms", sort=True):
        mixed = group[group["pd_split"] == "mixed"]
        split = group[group["pd_split"] != "mixed"]
        best_mixed = mixed.loc[mixed["capacity_per_gpu_rps"].idxmax()] if len(mixed) else None
        best_split = split.loc[split["capacity_per_gpu_rps"].idxmax()] if len(split) else None
        m = 0.0 if best_mixed is None else float(best_mixed["capacity_per_gpu_rps"])
        s = 0.0 if best_split is None else float(best_split["capacity_per_gpu_rps"])
        rows.append({"tpot_ms": tpot, "mixed_per_gpu": m, "split_per_gpu": s,
                     "best_split": None if best_split is None else best_split["pd_split"],
                     "winner": "split" if s > m else "mixed"})
    return pd.DataFrame(rows)


def crossovers(best: pd.DataFrame) -> list[tuple[float, float, str]]:
    """(TPOT below, TPOT above, the winner above) wherever the winner changes between neighbours."""
    out = []
    for (_, lo), (_, hi) in zip(best.iterrows(), best.iloc[1:].iterrows()):
        if lo["winner"] != hi["winner"]:
            out.append((float(lo["tpot_ms"]), float(hi["tpot_ms"]), str(hi["winner"])))
    return out
