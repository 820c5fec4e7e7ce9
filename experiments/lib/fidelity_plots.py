"""Figures of `experiments.fidelity`: per scenario, overlaid sim-vs-engine CDFs of TTFT, TPOT and
E2E latency and the fraction of GPU KV blocks in use over time."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from experiments.lib.fidelity_report import kv_usage

STYLE = {"engine": {"color": "tab:blue", "lw": 1.6}, "sim": {"color": "tab:orange", "lw": 1.2, "ls": "--"}}


def _cdf(ax, values: np.ndarray, label: str, style: dict) -> None:
    v = np.sort(values[~np.isnan(values)])
    if v.size:
        ax.step(v * 1e3, np.arange(1, v.size + 1) / v.size, where="post", label=label, **style)


def scenario_figure(name: str, runs: dict[str, tuple[pd.DataFrame, pd.DataFrame]], errors: dict[str, float]):
    """runs: {"engine": (requests, steps), "sim": (...)}; errors: metric -> relative error (titles)."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = (("ttft", "TTFT", "ttft_p90"), ("tpot", "TPOT", "tpot_mean"), ("e2e", "E2E latency", "e2e_mean"))
    for ax, (col, title, err_key) in zip(axes.flat, panels):
        for backend, (requests, _) in runs.items():
            done = requests[requests["status"] == "finished"]
            _cdf(ax, done[col].to_numpy(dtype=float), backend, STYLE[backend])
        err = errors.get(err_key)
        suffix = "" if err is None or np.isnan(err) else f"  ({err_key.replace('_', ' ')} error {err:+.1%})"
        ax.set_title(title + suffix, fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    for backend, (_, steps) in runs.items():
        if len(steps):
            t, used = kv_usage(steps)
            ax.step(t, used * 100, where="post", label=backend, **STYLE[backend])
    ax.set_title("GPU KV blocks in use", fontsize=10)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("% of GPU blocks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"{name}: engine vs simulator", fontsize=11)
    fig.tight_layout()
    return fig


def save_scenario_figure(path: str | Path, name: str, runs: dict[str, tuple[pd.DataFrame, pd.DataFrame]],
                         errors: dict[str, float]) -> Path:
    fig = scenario_figure(name, runs, errors)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
