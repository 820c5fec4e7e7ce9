"""Matplotlib figures of a run (written as PNGs by `experiments.run`, reused by the notebook and A/B)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

PREEMPT_MARKERS = {"recompute": ("x", "tab:red"), "swap": ("v", "tab:purple"),
                   "recompute_fallback": ("x", "tab:orange")}


THOUSANDS = FuncFormatter(lambda v, _: f"{v:,.0f}" if abs(v) >= 10 or v == int(v) else f"{v:g}")


def _end_times(steps: pd.DataFrame) -> np.ndarray:
    return (steps["time"] + steps["duration"]).to_numpy(dtype=float)


def _readable(ax, x_ticks: int = 6, y_counts: bool = True) -> None:
    """At most `x_ticks` x tick labels (long numbers never run into each other), thousands
    separators, and whole-number y ticks where y counts things."""
    ax.xaxis.set_major_locator(MaxNLocator(x_ticks))
    ax.xaxis.set_major_formatter(THOUSANDS)
    if y_counts:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_formatter(THOUSANDS)


def kv_figure(steps: pd.DataFrame, events: pd.DataFrame | None, block_size: int) -> Figure:
    """GPU blocks allocated vs. blocks' worth of real tokens (the gap is waste), the CPU swap pool,
    and preemption / swap events."""
    fig, (ax, ax_cpu) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, height_ratios=(3, 1))
    t = _end_times(steps)
    ax.step(t, steps["gpu_blocks_used"], where="post", label="GPU blocks allocated", lw=1)
    ax.step(t, steps["kv_tokens"] / block_size, where="post", label="blocks of real tokens", lw=1, alpha=0.8)
    if len(steps):
        pool = int(steps["gpu_blocks_total"].iloc[0])
        if steps["gpu_blocks_used"].max() >= 0.3 * pool:  # else the pool line would flatten the curves
            ax.axhline(pool, color="gray", ls="--", lw=0.8, label="GPU pool")
        ax.set_title(f"KV cache over time (GPU pool: {pool:,} blocks)")
    if events is not None and len(events):
        pre = events[events["event"] == "preempted"]
        for mode, (marker, color) in PREEMPT_MARKERS.items():
            at = pre.loc[pre["detail"] == mode, "time"].to_numpy(dtype=float)
            if len(at):
                y = np.interp(at, t, steps["gpu_blocks_used"].to_numpy(dtype=float)) if len(t) else at * 0
                ax.scatter(at, y, marker=marker, color=color, s=18, zorder=3, label=f"preempted ({mode})")
    ax.set_ylabel("KV blocks")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower center", fontsize=7, ncol=3)
    ax_cpu.step(t, steps["cpu_blocks_used"], where="post", color="tab:purple", lw=1)
    ax_cpu.set_ylim(bottom=0, top=max(1.0, float(steps["cpu_blocks_used"].max()) * 1.1) if len(steps) else 1.0)
    ax_cpu.set_ylabel("CPU swap\nblocks")
    ax_cpu.set_xlabel("time (s)")
    for a in (ax, ax_cpu):
        _readable(a)
    fig.tight_layout()
    return fig


def queues_figure(steps: pd.DataFrame) -> Figure:
    fig, ax = plt.subplots(figsize=(9, 3.5))
    t = _end_times(steps)
    for col in ("num_running", "num_waiting", "num_swapped"):
        ax.step(t, steps[col], where="post", label=col.removeprefix("num_"), lw=1)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("sequences")
    ax.set_title("Queue lengths over time")
    ax.set_ylim(bottom=0)
    _readable(ax)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _cdf(ax, values: np.ndarray, label: str) -> None:
    v = np.sort(np.asarray(values, dtype=float)[~np.isnan(np.asarray(values, dtype=float))])
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label, lw=1.2)


def latency_cdf_figure(runs: Mapping[str, pd.DataFrame]) -> Figure:
    """TTFT / TPOT / E2E CDFs in milliseconds; one line per run (label -> requests frame)."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for label, req in runs.items():
        done = req[req["status"] == "finished"]
        for ax, col in zip(axes, ("ttft", "tpot", "e2e")):
            _cdf(ax, done[col].to_numpy(dtype=float) * 1e3, label)
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)", "E2E latency (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        _readable(ax, x_ticks=5, y_counts=False)
    if len(runs) > 1:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def throughput_figure(runs: Mapping[str, tuple[pd.DataFrame, pd.DataFrame]], window_s: float | None = None) -> Figure:
    """Output tokens/s and mean ITL over time, in windows; label -> (requests, steps).
    Tokens are those of sample 0 of each request (`token_times`)."""
    fig, (ax_tp, ax_lat) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    for label, (req, steps) in runs.items():
        times = [np.asarray(t, dtype=float) for t in req["token_times"] if t is not None and len(t)]
        if not times or steps.empty:
            continue
        end = float(_end_times(steps)[-1])
        window = window_s or max(end / 50, 1e-3)
        bins = np.arange(0, end + window, window)
        counts, _ = np.histogram(np.concatenate(times), bins=bins)
        ax_tp.plot(bins[:-1], counts / window, label=label, lw=1)
        gaps = [(t[1:], np.diff(t)) for t in times if len(t) > 1]
        if gaps:
            at, itl = np.concatenate([g[0] for g in gaps]), np.concatenate([g[1] for g in gaps])
            sums, _ = np.histogram(at, bins=bins, weights=itl)
            n, _ = np.histogram(at, bins=bins)
            with np.errstate(invalid="ignore", divide="ignore"):
                ax_lat.plot(bins[:-1], sums / n * 1e3, label=label, lw=1)
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_title("Throughput and inter-token latency over time")
    ax_lat.set_ylabel("mean ITL (ms)")
    ax_lat.set_xlabel("time (s)")
    for a, counts in ((ax_tp, True), (ax_lat, False)):
        a.set_ylim(bottom=0)
        _readable(a, y_counts=counts)
    if len(runs) > 1:
        ax_tp.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _by_priority(requests: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """All requests, then each priority class when there are several (where policies differ most)."""
    runs = {"all requests": requests}
    if "priority" in requests and requests["priority"].nunique() > 1:
        runs |= {f"priority {p}": group for p, group in requests.groupby("priority", sort=True)}
    return runs


def save_run_plots(requests: pd.DataFrame, steps: pd.DataFrame, events: pd.DataFrame | None,
                   block_size: int, out_dir: str | Path) -> list[Path]:
    """A fleet's traces (a `replica` column) get the KV and queue figures once per replica."""
    out_dir = Path(out_dir)
    if "replica" in steps.columns:
        figures = {}
        for replica, own in steps.groupby("replica", sort=True):
            own_events = None if events is None else events[events["replica"] == replica]
            figures[f"kv_blocks_replica{replica}.png"] = kv_figure(own, own_events, block_size)
            figures[f"queues_replica{replica}.png"] = queues_figure(own)
    else:
        figures = {"kv_blocks.png": kv_figure(steps, events, block_size), "queues.png": queues_figure(steps)}
    figures["latency_cdf.png"] = latency_cdf_figure(_by_priority(requests))
    figures["throughput.png"] = throughput_figure({"run": (requests, steps)})
    paths = []
    for name, fig in figures.items():
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths

