"""How far each capacity of a search is known: the table's `capacity_status` and `bracket_width`,
and the summary's counts and lines that say which capacities are bounds rather than brackets."""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from experiments.lib.search.capacity import bracket_width

CONVERGED = "converged"  # the bracket [capacity, failed_rps) is at most search.rate.rtol wide
UNCONVERGED = "unconverged"  # search.rate.max_iterations ran out with a wider bracket
LOWER_BOUND = "lower_bound"  # no rate tried failed: the capacity is at least capacity_rps


def add_status(table: pd.DataFrame, rtol: float) -> None:
    """Adds `bracket_width` ((failed_rps - capacity_rps) / failed_rps; empty without a failing rate)
    and `capacity_status` (converged, unconverged, lower_bound; empty for a pruned row)."""
    ran = table["status"] != "pruned"
    failed = table["failed_rps"].astype(float)
    width = bracket_width(table["capacity_rps"], failed)
    table["bracket_width"] = width
    table["capacity_status"] = np.select([~ran, failed.isna(), width <= rtol], ["", LOWER_BOUND, CONVERGED],
                                         UNCONVERGED)


def status_counts(table: pd.DataFrame) -> dict[str, Any]:
    """summary.json's account of the capacities: how many of each status, and the widest bracket."""
    ran = table[table["status"] != "pruned"]
    counts = ran["capacity_status"].value_counts()
    wide = ran.loc[ran["capacity_status"] == UNCONVERGED, "bracket_width"]
    return {CONVERGED: int(counts.get(CONVERGED, 0)), UNCONVERGED: int(counts.get(UNCONVERGED, 0)),
            LOWER_BOUND: int(counts.get(LOWER_BOUND, 0)),
            "widest_bracket": float(wide.max()) if len(wide) else None}


def status_lines(table: pd.DataFrame, summary: dict[str, Any]) -> list[str]:
    """The printed lines for capacities that are not brackets within `rtol`: brackets left wider
    (and how wide), lower bounds (where the workload's requests stopped the rate, or the
    iterations ran out), and, with a fixed count of requests per run, that capacities are biased high."""
    ran = table[table["status"] != "pruned"]
    n, iterations = len(ran), summary["max_iterations"]
    lines = []
    wide = ran[ran["capacity_status"] == UNCONVERGED]
    if len(wide):
        lines.append(f"{len(wide)} of {n} capacities are brackets wider than search.rate.rtol={summary['rtol']:g} "
                     f"(up to {wide['bracket_width'].max():.0%}, column bracket_width): search.rate.max_iterations="
                     f"{iterations} ran out; raise it to narrow them")
    bounds = ran[ran["capacity_status"] == LOWER_BOUND]
    if len(bounds):
        limit = bounds["rate_limit_rps"].astype(float)
        why = []
        if limit.notna().any():
            why.append(f"{int(limit.notna().sum())} met the SLOs at the most the workload's requests cover for "
                       f"search.duration_s={summary['duration_s']:g} ({limit.max():.3g} req/s; a longer trace "
                       "raises it)")
        if limit.isna().any():
            why.append(f"{int(limit.isna().sum())} met them at every rate of their search.rate.max_iterations="
                       f"{iterations} (raise it)")
        lines.append(f"{len(bounds)} of {n} capacities are lower bounds (capacity_status=lower_bound, counted at "
                     "that bound in the cheapest pick and the Pareto front): " + "; ".join(why))
    if summary["duration_s"] is None:
        lines.append(f"search.duration_s=null: every run offers the same {summary['requests_per_run']} requests "
                     "whatever the rate, which an overload may absorb as one burst: capacities are biased high "
                     "(docs/search.md)")
    return lines
