"""The check's files: one JSON per measured deployment (`measured/<role>.json`: checks of the pick
and the neighbour may run as separate processes, on separate GPUs, into one folder) and the report
built from whichever are there: check.csv (a row per deployment), probes.csv (a row per run) and
check.md."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.lib.search.capacity import RateProbe
from experiments.lib.search.check_bracket import Bracket, CheckedProbe, rank_order
from experiments.lib.search.check_pick import SearchOutput, label
from experiments.lib.search.outputs import DEPLOYMENT_COLUMNS, slo_text

ROLES = ("pick", "neighbour")


@dataclass(slots=True)
class Measured:
    role: str
    row: dict[str, Any]  # the search's table row (dimensions, $/h, predicted capacity, cache key)
    bracket: Bracket
    backend: str
    device: str
    wall_s: float  # the role's whole check, warm-up included

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "row": self.row, "predicted": self.bracket.predicted, "within": self.bracket.within,
                "backend": self.backend, "device": self.device, "wall_s": self.wall_s,
                "probes": [{"factor": p.factor, "rate": p.probe.rate, "met": p.probe.met, "missed": p.probe.missed,
                            "metrics": p.probe.metrics, "wall_s": p.wall_s} for p in self.bracket.probes]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Measured:
        probes = [CheckedProbe(p["factor"], RateProbe(p["rate"], p["met"], p["metrics"], p["missed"]), p["wall_s"])
                  for p in d["probes"]]
        return cls(d["role"], d["row"], Bracket(d["predicted"], d["within"], probes), d["backend"], d["device"],
                   d["wall_s"])


def save(out_dir: Path, m: Measured) -> None:
    path = out_dir / "measured" / f"{m.role}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(m.to_json(), indent=1, default=str) + "\n")


def load_measured(out_dir: Path, rows: dict[str, dict[str, Any]]) -> dict[str, Measured]:
    """The measurements in `out_dir` of these rows (role -> the search's row); a file of another
    deployment or of another search (an earlier check into the same folder: another cache key,
    which hashes the run config, workload and SLOs) is ignored."""
    found = {}
    for role, row in rows.items():
        path = out_dir / "measured" / f"{role}.json"
        if path.is_file():
            m = Measured.from_json(json.loads(path.read_text()))
            same = all(str(m.row.get(c)) == str(row.get(c)) for c in (*DEPLOYMENT_COLUMNS, "key"))
            if same:
                found[role] = m
    return found


def write_report(out_dir: Path, search: SearchOutput, rows: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """check.csv, probes.csv and check.md from the measurements in `out_dir`."""
    measured = load_measured(out_dir, rows)
    table, probes = [], []
    for role, row in rows.items():
        m = measured.get(role)
        rec = {"role": role, **{c: row[c] for c in DEPLOYMENT_COLUMNS}, "dollars_per_hour": row["dollars_per_hour"],
               "predicted_rps": row["capacity_rps"]}
        if m is None:
            table.append(rec | {"verdict": "not measured"})
            continue
        b = m.bracket
        lo, hi = b.error_range()
        table.append(rec | {"measured_low_rps": b.low, "measured_high_rps": b.high if math.isfinite(b.high) else None,
                            "error_low": lo, "error_high": hi if math.isfinite(hi) else None,
                            "within": b.is_within, "verdict": b.verdict(), "runs": len(b.probes),
                            "backend": m.backend, "device": m.device, "wall_s": m.wall_s})
        for p in b.probes:
            probes.append({"role": role, "factor": p.factor, "rate": p.probe.rate, "met": p.probe.met,
                           "missed": ",".join(p.probe.missed), **p.probe.metrics, "wall_s": p.wall_s})
    order = "not measured"
    if len(measured) == len(ROLES):
        order = rank_order((measured["pick"].bracket, rows["pick"]["dollars_per_hour"]),
                           (measured["neighbour"].bracket, rows["neighbour"]["dollars_per_hour"]), search.target_rate)
    frame = pd.DataFrame(table)
    frame["rank_order"] = order
    out_dir.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out_dir / "check.csv", index=False)
    pd.DataFrame(probes).to_csv(out_dir / "probes.csv", index=False)
    (out_dir / "check.md").write_text(_markdown(search, rows, measured, order))
    return frame


def _markdown(search: SearchOutput, rows: dict[str, dict[str, Any]], measured: dict[str, Measured], order: str) -> str:
    s = search.summary
    backends = sorted({f"{m.backend} ({m.device})" for m in measured.values()}) or ["none yet"]
    lines = [f"# Capacity search checked: {s['model']}, {s['workload']}",
             "",
             f"Search: `{search.path}` ({s.get('latency')} latency model), SLO {slo_text(search.slo)}, "
             f"target {search.target_rate:g} req/s, {search.duration_s or 'workload.num_requests'} s of arrivals "
             f"per run. Measured on: {', '.join(backends)}.",
             "",
             "| role | deployment | predicted req/s | runs (rate: met?) | measured capacity | verdict |",
             "|---|---|---:|---|---|---|"]
    for role, row in rows.items():
        m = measured.get(role)
        if m is None:
            lines.append(f"| {role} | {label(row)} | {row['capacity_rps']:.3g} | | | not measured |")
            continue
        b = m.bracket
        runs = ", ".join(f"{p.probe.rate:.3g} ({p.factor:.2f}x): {'met' if p.probe.met else 'missed ' + ','.join(p.probe.missed)}"
                         for p in b.probes)
        high = f"{b.high:.3g}" if math.isfinite(b.high) else "not found"
        lines.append(f"| {role} | {label(row)} | {b.predicted:.3g} | {runs} | [{b.low:.3g}, {high}) | {b.verdict()} |")
    lines += ["", f"Rank order of the pick before the neighbour on the measured capacities: **{order}**.", ""]
    open_ended = [role for role, row in rows.items() if not _finite(row.get("failed_rps"))]
    if open_ended:
        lines += [f"The search found no failing rate for the {' and '.join(open_ended)} (search.rate.max_iterations "
                  "ran out while the SLOs held): its predicted capacity is a lower bound.", ""]
    return "\n".join(lines)


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
