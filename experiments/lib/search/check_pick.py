"""What `experiments.search_check` checks of a search's output folder: the search's top pick (the
cheapest deployment for its target rate) and a rejected neighbour (the best-ranked deployment that
differs from the pick in one dimension and ranks below it), each with its run configuration."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from experiments.lib.paths import REPO_ROOT
from experiments.lib.search.catalogue import load_catalogue
from experiments.lib.search.outputs import CONFIG_FILE, DEPLOYMENT_COLUMNS, largest_capacity
from experiments.lib.search.slo import SearchSlo
from experiments.lib.search.space import Deployment, run_config

# Backends that run a fleet of replicas; the others (engine, server) run one replica.
FLEET_BACKENDS = ("sim",)


@dataclass(slots=True)
class SearchOutput:
    """A search's output folder as the check reads it."""
    path: Path
    table: pd.DataFrame
    summary: dict[str, Any]
    config: DictConfig  # the search's composed configuration (conf/search.yaml + its overrides)

    @property
    def target_rate(self) -> float:
        return float(self.summary["target_rate"])

    @property
    def slo(self) -> SearchSlo:
        return SearchSlo.from_dict(OmegaConf.to_container(self.config.search.slo, resolve=True))  # type: ignore[arg-type]

    @property
    def duration_s(self) -> float | None:
        d = self.config.search.get("duration_s")
        return None if d is None else float(d)

    def run_config(self, row: pd.Series, backend: str) -> DictConfig:
        """The `experiments.run` configuration of a table row on `backend` (conf/backend/<name>.yaml)."""
        d = deployment(row)
        catalogue = load_catalogue(OmegaConf.to_container(self.config.catalogue, resolve=True))  # type: ignore[arg-type]
        cfg = run_config(self.config, d, catalogue[d.gpu])
        cfg.backend = OmegaConf.load(REPO_ROOT / "conf" / "backend" / f"{backend}.yaml")
        cfg.progress = False
        cfg.plots = False
        return cfg


def load_output(path: str | Path) -> SearchOutput:
    """A search's output folder: table.csv, summary.json and the composed config (config.yaml, or
    Hydra's .hydra/config.yaml of a search written before config.yaml was)."""
    path = Path(path)
    where = f"result={str(path)!r}"
    if not path.is_dir():
        raise ValueError(f"{where} is not a folder: give the output folder of python -m experiments.search "
                         "(outputs/search/<date>/<time>)")
    for name in ("table.csv", "summary.json"):
        if not (path / name).is_file():
            raise ValueError(f"{where} has no {name}: give the output folder of python -m experiments.search "
                             "(outputs/search/<date>/<time>)")
    config = next((p for p in (path / CONFIG_FILE, path / ".hydra" / "config.yaml") if p.is_file()), None)
    if config is None:
        raise ValueError(f"{where} has neither {CONFIG_FILE} nor .hydra/config.yaml: the check needs the search's "
                         "configuration (its workload, SLOs and run settings); rerun the search")
    table = pd.read_csv(path / "table.csv")
    missing = [c for c in (*DEPLOYMENT_COLUMNS, "status", "capacity_rps", "dollars_per_hour") if c not in table]
    if missing:
        raise ValueError(f"{where}: table.csv lacks the columns {missing}")
    return SearchOutput(path, table, json.loads((path / "summary.json").read_text()), OmegaConf.load(config))


def deployment(row: pd.Series | dict[str, Any]) -> Deployment:
    return Deployment(str(row["gpu"]), int(row["tensor_parallel_size"]), int(row["replicas"]),
                      int(row["max_num_seqs"]), int(row["max_num_batched_tokens"]), str(row["policy"]),
                      str(row["router"]))


def rank_key(capacity: float, dollars_per_hour: float, target: float) -> tuple[int, float, float]:
    """The search's order (outputs.finish): deployments reaching the target first, cheapest first,
    then the larger capacity; those below it by capacity, largest first."""
    if capacity >= target:
        return (0, dollars_per_hour, -capacity)
    return (1, -capacity, -capacity)


def ranked(table: pd.DataFrame, target: float) -> pd.DataFrame:
    """The simulated (not pruned) rows in the search's order; ties keep the table's order."""
    ran = table[table["status"] != "pruned"].copy()
    ran["_rank"] = [rank_key(c, d, target) for c, d in zip(ran["capacity_rps"], ran["dollars_per_hour"])]
    return ran.sort_values("_rank", kind="stable").drop(columns="_rank")


def runnable_reason(row: pd.Series, backend: str) -> str | None:
    """Why `backend` cannot run this deployment as the search priced it (None: it can)."""
    if int(row["replicas"]) != 1 and backend not in FLEET_BACKENDS:
        return (f"replicas={int(row['replicas'])}: backend={backend} runs one replica (cluster.replicas=1); "
                "search with search.space.replicas=[1] to check on it")
    return None


def choose_pick(out: SearchOutput, backend: str) -> pd.Series:
    """The search's answer: the cheapest deployment whose capacity reaches the target rate."""
    order = ranked(out.table, out.target_rate)
    if out.summary.get("cheapest") is None or order.empty or not order.iloc[0]["capacity_rps"] >= out.target_rate:
        best = largest_capacity(out.table, out.config.search.get("rate", {}).get("max_iterations"))
        raise ValueError(f"result={str(out.path)!r} has no pick: summary.json cheapest=null, no deployment reaches "
                         f"search.target_rate={out.target_rate:g} req/s ({best}); rerun the search with a lower "
                         "search.target_rate")
    pick = order.iloc[0]
    reason = runnable_reason(pick, backend)
    if reason is not None:
        raise ValueError(f"the search's pick ({label(pick)}) cannot be checked: {reason}")
    return pick


def choose_neighbour(out: SearchOutput, pick: pd.Series, backend: str, dimension: str | None = None) -> pd.Series:
    """The best-ranked deployment below the pick that differs from it in one dimension (`dimension`
    if given), has a capacity to bracket and can run on `backend`."""
    if dimension is not None and dimension not in DEPLOYMENT_COLUMNS:
        raise ValueError(f"--neighbour-dimension={dimension!r} is unknown: choose one of {DEPLOYMENT_COLUMNS}")
    target = out.target_rate
    pick_key = rank_key(pick["capacity_rps"], pick["dollars_per_hour"], target)
    skipped: list[str] = []
    for _, row in ranked(out.table, target).iterrows():
        differs = [c for c in DEPLOYMENT_COLUMNS if row[c] != pick[c]]
        if len(differs) != 1 or (dimension is not None and differs != [dimension]):
            continue
        if not rank_key(row["capacity_rps"], row["dollars_per_hour"], target) > pick_key:
            continue  # ranks with the pick (a tie) or above it
        if not row["capacity_rps"] > 0:
            continue  # met the SLOs at no rate: no capacity to bracket
        reason = runnable_reason(row, backend)
        if reason is not None:
            skipped.append(f"{label(row)}: {reason}")
            continue
        return row
    within = f"search.space.{dimension}" if dimension is not None else "one dimension"
    extra = f" ({len(skipped)} skipped, e.g. {skipped[0]})" if skipped else ""
    raise ValueError(f"result={str(out.path)!r} has no neighbour to check: no deployment differs from the pick "
                     f"({label(pick)}) in {within} and ranks below it with a capacity > 0{extra}; widen search.space")


def label(row: pd.Series | dict[str, Any]) -> str:
    """A deployment in one line, its $/h and its predicted capacity."""
    cap = row.get("capacity_rps", math.nan)
    return (f"{int(row['replicas'])} x {row['gpu']} TP{int(row['tensor_parallel_size'])}, "
            f"max_num_seqs={int(row['max_num_seqs'])}, max_num_batched_tokens={int(row['max_num_batched_tokens'])}, "
            f"policy={row['policy']}, ${float(row['dollars_per_hour']):.2f}/h, predicted {float(cap):.3g} req/s")


def device_reason(row: pd.Series | dict[str, Any], hardware_name: str, device_names: list[str]) -> str | None:
    """Why the visible GPUs (`device_names`) cannot run the deployment as the search priced it:
    none, fewer than its tensor-parallel size, or another GPU type than its `hardware_name`."""
    tp = int(row["tensor_parallel_size"])
    if not device_names:
        return "backend=engine needs a GPU and none is visible (--backend sim checks the search against the simulator)"
    if tp > len(device_names):
        return (f"tensor_parallel_size={tp} needs {tp} GPUs and {len(device_names)} is visible "
                f"(CUDA_VISIBLE_DEVICES)")
    kind = hardware_name.split("-")[0].lower()
    if kind not in device_names[0].lower():
        return (f"gpu={row['gpu']!r} (conf/hardware {hardware_name!r}) is not the engine's GPU "
                f"{device_names[0]!r}: run the check on the GPU type the search priced")
    return None
