"""A/B comparison of two run configs on one request stream: the runs, the paired per-request
table with bootstrap confidence intervals, the run-level table, their markdown and figure, and
the combination of tables over rounds (`python -m experiments.ab`, the fidelity study and the
showcase all compare through `compare` / `ab_table` here).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

from experiments.lib import factory
from experiments.lib.bootstrap import combine_rounds, paired_bootstrap
from experiments.lib.run_workload import run

LATENCY_METRICS = ("ttft", "tpot", "e2e", "queueing_time")
LATENCY_STATS = ("mean", "p50", "p90", "p99")
CLASS_STATS = ("mean", "p90")
RUN_METRICS = ("request_throughput", "output_throughput", "goodput", "mean_batch_size", "num_preemptions",
               "swap_out_blocks", "kv_utilization", "duration_s")


@dataclass(slots=True)
class ABResult:
    table: pd.DataFrame
    summary_a: dict[str, Any]
    summary_b: dict[str, Any]
    out_dir: Path


def compose_pair(common: Sequence[str], a: Sequence[str], b: Sequence[str]) -> tuple[DictConfig, DictConfig]:
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg_a = compose(config_name="config", overrides=[*common, *a])
        cfg_b = compose(config_name="config", overrides=[*common, *b])
    for key in ("workload", "seed"):
        if OmegaConf.to_container(cfg_a, resolve=True)[key] != OmegaConf.to_container(cfg_b, resolve=True)[key]:
            raise ValueError(f"a and b differ in {key}: an A/B comparison runs one request stream, "
                             f"so put {key} overrides among the common ones")
    return cfg_a, cfg_b


def _paired(req_a: pd.DataFrame, req_b: pd.DataFrame) -> pd.DataFrame:
    cols = ["request_id", "priority", "status", *LATENCY_METRICS]
    if "tenant" in req_a and "tenant" in req_b:
        cols.insert(2, "tenant")
    both = req_a[cols].merge(req_b[cols], on="request_id", suffixes=("_a", "_b"), validate="one_to_one")
    if len(both) != len(req_a) or len(both) != len(req_b):
        raise ValueError(f"A and B ended different request sets ({len(req_a)} vs {len(req_b)} rows, "
                         f"{len(both)} shared): they must run the same stream")
    return both[(both["status_a"] == "finished") & (both["status_b"] == "finished")]


def paired_table(req_a: pd.DataFrame, req_b: pd.DataFrame, resamples: int = 1000,
                 confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One row per (metric, stat, class): A, B, B - A with its bootstrap CI, relative change."""
    both = _paired(req_a, req_b)
    groups = [("all", both)]
    if both["priority_a"].nunique() > 1:
        groups += [(f"priority={p}", g) for p, g in both.groupby("priority_a", sort=True)]
    if "tenant_a" in both and both["tenant_a"].nunique() > 1:
        groups += [(f"tenant={t}", g) for t, g in both.groupby("tenant_a", sort=True)]
    rows = []
    for scope, g in groups:
        for metric in LATENCY_METRICS:
            pair = g[[f"{metric}_a", f"{metric}_b"]].dropna()
            if pair.empty:
                continue
            a, b = pair.iloc[:, 0].to_numpy(), pair.iloc[:, 1].to_numpy()
            for stat in (LATENCY_STATS if scope == "all" else CLASS_STATS):
                diff, low, high = paired_bootstrap(a, b, stat, resamples, confidence, seed)
                base = float(np.mean(a)) if stat == "mean" else float(np.percentile(a, int(stat[1:])))
                rows.append({"metric": metric, "stat": stat, "scope": scope, "n": len(a), "a": base,
                             "b": base + diff, "diff": diff, "ci_low": low, "ci_high": high,
                             "rel_diff": diff / base if base else np.nan,
                             "significant": bool(low > 0 or high < 0)})
    return pd.DataFrame(rows)


def run_table(summary_a: dict[str, Any], summary_b: dict[str, Any]) -> pd.DataFrame:
    """Run-level metrics (one value per run, so no interval)."""
    rows = []
    for m in RUN_METRICS:
        a, b = summary_a.get(m), summary_b.get(m)
        if a is None or b is None:
            continue
        rows.append({"metric": m, "stat": "run", "scope": "all", "n": summary_a["completed"], "a": float(a),
                     "b": float(b), "diff": float(b) - float(a), "ci_low": np.nan, "ci_high": np.nan,
                     "rel_diff": (float(b) - float(a)) / float(a) if a else np.nan, "significant": None})
    return pd.DataFrame(rows)


def ab_table(summary_a: dict[str, Any], req_a: pd.DataFrame, summary_b: dict[str, Any], req_b: pd.DataFrame,
             resamples: int = 1000, confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One A/B pair's table: the paired per-request rows, then the run-level rows."""
    return pd.concat([paired_table(req_a, req_b, resamples, confidence, seed), run_table(summary_a, summary_b)],
                     ignore_index=True)


def markdown(table: pd.DataFrame, label_a: str, label_b: str, confidence: float) -> str:
    head = (f"| metric | scope | stat | A: {label_a} | B: {label_b} | B - A | {confidence:.0%} CI | change |\n"
            "|---|---|---|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in table.itertuples():
        latency = r.metric in LATENCY_METRICS
        f = (lambda x: f"{x * 1e3:.1f} ms") if latency else (lambda x: f"{x:,.3g}")
        ci = "-" if np.isnan(r.ci_low) else f"[{f(r.ci_low)}, {f(r.ci_high)}]"
        change = "-" if np.isnan(r.rel_diff) else f"{r.rel_diff:+.1%}" + (" *" if r.significant else "")
        lines.append(f"| {r.metric} | {r.scope} | {r.stat} | {f(r.a)} | {f(r.b)} | {f(r.diff)} | {ci} | {change} |")
    rounds = int(table["rounds"].max()) if "rounds" in table else 1
    why = ("the confidence interval excludes 0 (paired bootstrap over requests)" if rounds == 1 else
           f"in each of {rounds} rounds the interval excludes 0, the rounds agree in sign and the mean change "
           "exceeds half the range of A's and of B's values over the rounds (per-round changes in ab.csv)")
    return "\n".join(lines) + f"\n\n`*`: {why}.\n"


def ab_figure(table: pd.DataFrame, req_a: pd.DataFrame, req_b: pd.DataFrame, label_a: str, label_b: str):
    import matplotlib.pyplot as plt

    from experiments.lib.plots import latency_cdf_figure
    lat = table[(table["metric"].isin(LATENCY_METRICS)) & (table["stat"] != "run")].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(lat) + 1.2))
    y = np.arange(len(lat))[::-1]
    rel = lat["rel_diff"].to_numpy() * 100
    base = lat["a"].replace(0, np.nan).to_numpy()
    err = np.vstack([(lat["diff"] - lat["ci_low"]) / base, (lat["ci_high"] - lat["diff"]) / base]) * 100
    ax.errorbar(rel, y, xerr=np.nan_to_num(err), fmt="o", ms=3, capsize=2)
    ax.axvline(0, color="gray", lw=0.8)
    ax.set_yticks(y, [f"{r.metric} {r.stat} ({r.scope})" for r in lat.itertuples()], fontsize=7)
    ax.set_xlabel(f"B ({label_b}) vs A ({label_a}): change in % with CI")
    fig.tight_layout()
    cdf = latency_cdf_figure({f"A: {label_a}": req_a, f"B: {label_b}": req_b})
    return fig, cdf


def combine_tables(tables: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The tables of one A/B repeated in rounds, row by row (`combine_rounds`): mean A, B and B - A,
    the widest interval, `significant` by the rounds' rule, and each round's change in `round_changes`;
    one round's table as it is."""
    if len(tables) == 1:
        return tables[0]
    key = ["metric", "stat", "scope"]
    first = tables[0].set_index(key)
    rows = []
    for idx in first.index:
        per_round = [t.set_index(key).loc[idx].to_dict() for t in tables if idx in t.set_index(key).index]
        if len(per_round) != len(tables):
            continue  # a class or metric missing in some round
        row = dict(zip(key, idx)) | combine_rounds(per_round)
        row["n"] = per_round[0]["n"]
        row["rel_diff"] = row["diff"] / row["a"] if row["a"] else np.nan
        row["round_changes"] = " ".join(f"{r['rel_diff']:+.1%}" for r in per_round)
        rows.append(row)
    return pd.DataFrame(rows)


def _warmups(cfg_a: DictConfig, cfg_b: DictConfig, warmup: bool | None, label_a: str,
             label_b: str) -> list[tuple[str, DictConfig, str]]:
    """(run dir, config, label) of the unrecorded warm-up runs: A's, and B's too when B runs another
    engine (its own shapes to compile); by default only configs on backend=engine warm up."""
    on = [warmup if warmup is not None else cfg.backend.name == "engine" for cfg in (cfg_a, cfg_b)]
    runs = [("_warmup", cfg_a, label_a)] if on[0] else []
    if on[1] and not (on[0] and _same_engine(cfg_a, cfg_b)):
        runs.append(("_warmup_b", cfg_b, label_b))
    return runs


def _same_engine(cfg_a: DictConfig, cfg_b: DictConfig) -> bool:
    if cfg_a.backend.name != "engine" or cfg_b.backend.name != "engine":
        return cfg_a.backend.name == cfg_b.backend.name
    from experiments.lib.engine_backend import engine_args, engine_key
    return engine_key(engine_args(cfg_a)) == engine_key(engine_args(cfg_b))


def compare(cfg_a: DictConfig, cfg_b: DictConfig, out_dir: str | Path, label_a: str = "A", label_b: str = "B",
            resamples: int = 1000, confidence: float = 0.95, rounds: int = 1, warmup: bool | None = None) -> ABResult:
    """A then B on one request stream, `rounds` times (A, B, A, B, ...: on a wall-clock backend each
    round's pair runs under one host state, and the rounds show whether a difference reproduces).
    `warmup` (default: on for backend=engine) runs A once, unrecorded, into `_warmup/` first: the
    engine's first run compiles Triton and torch.compile variants for new shapes, which on an H200
    made the first round's A up to 46% slower in TTFT than A in later rounds."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid: must be an integer >= 1")
    out_dir = Path(out_dir)
    workload = factory.workload(cfg_a)
    for name, cfg, label in _warmups(cfg_a, cfg_b, warmup, label_a, label_b):
        run(cfg, out_dir / name, f"warm-up: {label}", workload.fresh())
    tables, summaries, reqs = [], [], []
    for i in range(rounds):
        suffix, note = ("", "") if i == 0 else (f"_r{i + 1}", f" (round {i + 1})")
        summary_a = run(cfg_a, out_dir / f"a{suffix}", f"A: {label_a}{note}", workload.fresh())
        summary_b = run(cfg_b, out_dir / f"b{suffix}", f"B: {label_b}{note}", workload.fresh())
        req_a = pd.read_parquet(out_dir / f"a{suffix}" / "requests.parquet")
        req_b = pd.read_parquet(out_dir / f"b{suffix}" / "requests.parquet")
        tables.append(ab_table(summary_a, req_a, summary_b, req_b, resamples, confidence, int(cfg_a.seed)))
        summaries.append((summary_a, summary_b))
        reqs.append((req_a, req_b))
    table = combine_tables(tables)
    table.to_csv(out_dir / "ab.csv", index=False)
    (out_dir / "ab.md").write_text(markdown(table, label_a, label_b, confidence))
    fig, cdf = ab_figure(table, *reqs[0], label_a, label_b)
    fig.savefig(out_dir / "ab.png", dpi=110)
    cdf.savefig(out_dir / "ab_cdf.png", dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    plt.close(cdf)
    return ABResult(table, *summaries[0], out_dir)
