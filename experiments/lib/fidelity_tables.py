"""What the runs of `experiments.fidelity` become: per scenario the simulator's errors against the
engine (`error_table`), the KV hand-off's errors of disaggregated scenarios (`transfer_table`), the
spec's goodput comparison (`goodput`), its A/B rankings (`ranking`), and the report directory
written from them (`write`: fidelity.md, the CSVs, meta.json, one figure per scenario). The runs
themselves (which configs, in which order, how often) are the command's (experiments/fidelity.py);
the arithmetic of each table is experiments/lib/fidelity_report.py's pure functions.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.lib.ab_compare import ab_table, combine_tables
from experiments.lib.fidelity_goodput import GoodputSpec, goodput_markdown, goodput_rows
from experiments.lib.fidelity_plots import save_scenario_figure
from experiments.lib.fidelity_report import (
    TRANSFER_METRICS,
    error_markdown,
    error_rows,
    error_table,
    metric_values,
    ranking_row,
    relative_error,
    report_markdown,
    step_breakdown_rows,
    target_summary,
)

STALL_S = 0.25  # engine steps longer than this are stalls (JIT compiles, GC) no profile predicts


class FidelityTables:
    """Mixed into `Fidelity`: reads its `spec`, `results` (scenario -> engine and sim runs) and
    `settings` (scenario -> what the report states about it)."""

    __slots__ = ()

    def error_table(self) -> pd.DataFrame:
        rows = []
        for name, res in self.results.items():
            rows += error_rows(res["engine"][0], res["sim"][0], name, res["engine_summaries"])
        return error_table(rows)

    @staticmethod
    def _comparable_steps(res: dict[str, Any]) -> pd.DataFrame:
        """The simulator's steps of the replicas the engine trace holds: an engine pair's trace holds
        both engines' steps (replica 0 the prefill engine's, 1 the decode engine's, carried to the
        front), one taken before the decode engine's steps were carried its prefill engine's only."""
        steps, engine_steps = res["sim"][2], res["engine"][2]
        if "replica" in steps.columns and "replica" in engine_steps.columns:
            return steps[steps["replica"].isin(engine_steps["replica"].unique())]
        return steps

    def transfer_table(self) -> pd.DataFrame:
        """The KV hand-off's errors (TRANSFER_METRICS) of the disaggregated scenarios."""
        rows = []
        for name, res in self.results.items():
            if res["engine"][0].get("disaggregation"):
                rows += error_rows(res["engine"][0], res["sim"][0], name, res["engine_summaries"], TRANSFER_METRICS)
        return error_table(rows)

    def goodput(self) -> tuple[GoodputSpec | None, list[dict[str, Any]]]:
        """The spec's goodput comparison (fidelity_goodput.py) over the runs: (its spec, its rows)."""
        if not self.spec.get("goodput"):
            return None, []
        spec = GoodputSpec.parse(self.spec["goodput"], self.spec["scenarios"], "goodput")
        return spec, goodput_rows(spec, self.results)

    def ranking(self) -> list[dict[str, Any]]:
        """The spec's A/B rows. The engine's difference is taken per round (A and B of one round ran
        minutes apart at most, under one host speed) and combined by `ab.combine_tables`."""
        rows = []
        for ab in self.spec.get("ab", []):
            if ab["a"] not in self.results or ab["b"] not in self.results:
                continue
            res_a, res_b = self.results[ab["a"]], self.results[ab["b"]]
            tables = {"engine": combine_tables([ab_table(sa, ra, sb, rb) for (sa, ra, _), (sb, rb, _)
                                                in zip(res_a["engine_runs"], res_b["engine_runs"])]),
                      "sim": ab_table(*res_a["sim"][:2], *res_b["sim"][:2])}
            for spec in ab["metrics"]:
                metric, stat, scope = spec.split()
                picked = {}
                for backend, t in tables.items():
                    sel = t[(t["metric"] == metric) & (t["stat"] == stat) & (t["scope"] == scope)]
                    if len(sel):
                        picked[backend] = sel.iloc[0].to_dict()
                if len(picked) == 2:
                    rows.append(ranking_row(ab["name"], f"{metric} {stat} ({scope})", picked["engine"], picked["sim"]))
        return rows

    def write(self, out_dir: Path, meta: dict[str, Any]) -> str:
        out_dir.mkdir(parents=True, exist_ok=True)
        table, ranking, transfer = self.error_table(), self.ranking(), self.transfer_table()
        goodput_spec, goodput = self.goodput()
        breakdown = [row for name, res in self.results.items()
                     for row in step_breakdown_rows(res["engine"][2], self._comparable_steps(res), name)]
        table.to_csv(out_dir / "fidelity.csv", index=False)
        pd.DataFrame(ranking).to_csv(out_dir / "ranking.csv", index=False)
        pd.DataFrame(breakdown).to_csv(out_dir / "steps.csv", index=False)
        sections = ""
        if len(transfer):
            transfer.to_csv(out_dir / "transfer.csv", index=False)
            sections += (f"## KV transfer (disaggregated scenarios)\n\n{error_markdown(transfer, TRANSFER_METRICS)}\n"
                         f"{target_summary(transfer)}.\n\n")
        if goodput_spec is not None:
            pd.DataFrame(goodput).to_csv(out_dir / "goodput.csv", index=False)
            sections += f"## Goodput per GPU: split against mixed\n\n{goodput_markdown(goodput_spec, goodput)}\n"
        for name, res in self.results.items():
            errs = {m: relative_error(metric_values(res["sim"][0])[m], v)
                    for m, v in metric_values(res["engine"][0]).items()}
            save_scenario_figure(out_dir / f"{name}.png", name,
                                 {b: (res[b][1], res[b][2]) for b in ("engine", "sim")}, errs)
        meta = {**meta, "scenarios": self.settings, "targets": target_summary(pd.concat([table, transfer], ignore_index=True))}
        (out_dir / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        text = report_markdown(meta, table, ranking, breakdown, self.settings, STALL_S, sections)
        (out_dir / "fidelity.md").write_text(text)
        return text
