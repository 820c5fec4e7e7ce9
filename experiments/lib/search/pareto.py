"""The Pareto front of a search's table (lower $/h, higher capacity) and its plot."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.lib.search.status import LOWER_BOUND


def pareto_front(table: pd.DataFrame, cost: str = "dollars_per_hour", capacity: str = "capacity_rps") -> pd.DataFrame:
    """The rows no other row dominates (one at most as costly with at least the capacity, better in
    one), by cost ascending; rows without a capacity > 0 are left out. Of equal rows, the first."""
    rows = table[table[capacity] > 0].sort_values([cost, capacity], ascending=[True, False], kind="stable")
    keep, best = [], -1.0
    for index, row in rows.iterrows():
        if row[capacity] > best:
            keep.append(index)
            best = row[capacity]
    return rows.loc[keep]


def plot_front(table: pd.DataFrame, front: pd.DataFrame, path: str | Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = table[table["capacity_rps"] > 0]
    for gpu, group in ok.groupby("gpu", sort=True):
        dots = ax.scatter(group["dollars_per_hour"], group["capacity_rps"], s=12, alpha=0.5, label=str(gpu))
        bound = group[group["capacity_status"] == LOWER_BOUND]
        if len(bound):  # a capacity that is at least this: an upward triangle over its dot
            ax.scatter(bound["dollars_per_hour"], bound["capacity_rps"], s=30, marker="^", facecolors="none",
                       edgecolors=dots.get_facecolor()[:1])
    ax.step(front["dollars_per_hour"], front["capacity_rps"], where="post", color="k", lw=1.2, label="Pareto front")
    ax.scatter(front["dollars_per_hour"], front["capacity_rps"], color="k", s=18, zorder=3)
    ax.set_xlabel("cost ($/h)")
    ax.set_ylabel("capacity within SLOs (req/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
