"""DistServe's comparison inside a fidelity spec: goodput per GPU of a prefill/decode split against
co-located (mixed) replicas on the same GPUs and the same request stream, under several SLOs applied
to the same runs (no run per SLO), on the engine and in the simulator side by side.

The spec's `goodput` section (conf/fidelity/disagg.yaml):

    goodput:
      margin: 0.05                       # the split "beats" mixed when its goodput/GPU is > (1 + margin) x mixed's
      slos:                              # name -> SLO; split_wins: the claim to check (null: none)
        tight: {ttft_s: 1.0, tpot_s: 0.01, split_wins: true}
        loose: {ttft_s: 1.0, tpot_s: 0.05, split_wins: false}
      comparisons:                       # name -> a split scenario and a mixed one (same stream, same GPUs)
        load_500: {split: pd_500, mixed: mixed_500}

Goodput per GPU is `experiments.lib.metrics.goodput` (finished requests meeting every SLO set, per
second, over the run's GPUs: summary.json's `num_gpus`), the simulator's own metric.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from experiments.lib.metrics import check_slo_seconds, goodput

BACKENDS = ("engine", "sim")


@dataclass(slots=True, frozen=True)
class GoodputSlo:
    name: str
    ttft_s: float | None
    tpot_s: float | None
    split_wins: bool | None  # the claim: the split beats mixed under it (None: no claim)

    @property
    def slo(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s}


@dataclass(slots=True, frozen=True)
class GoodputComparison:
    name: str
    split: str  # scenario of the prefill/decode split
    mixed: str  # scenario of the co-located replicas


@dataclass(slots=True, frozen=True)
class GoodputSpec:
    slos: tuple[GoodputSlo, ...]
    comparisons: tuple[GoodputComparison, ...]
    margin: float = 0.05

    @classmethod
    def parse(cls, section: Mapping[str, Any], scenarios: Mapping[str, Any], where: str) -> GoodputSpec:
        """The spec's `goodput` section, checked against its scenarios (errors name the key)."""
        margin = section.get("margin", 0.05)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"spec {where}: goodput.margin={margin!r} is invalid: must be a number in [0, 1)")
        slos = []
        for name, s in (section.get("slos") or {}).items():
            if s.get("ttft_s") is None and s.get("tpot_s") is None:
                raise ValueError(f"spec {where}: goodput.slos.{name} is invalid: set ttft_s, tpot_s or both")
            for key in ("ttft_s", "tpot_s"):
                check_slo_seconds(s.get(key), f"spec {where}: goodput.slos.{name}.{key}")
            slos.append(GoodputSlo(str(name), s.get("ttft_s"), s.get("tpot_s"), s.get("split_wins")))
        comparisons = []
        for name, c in (section.get("comparisons") or {}).items():
            for key in ("split", "mixed"):
                if c.get(key) not in scenarios:
                    raise ValueError(f"spec {where}: goodput.comparisons.{name}.{key}={c.get(key)!r} is invalid: "
                                     f"not a scenario of the spec ({sorted(scenarios)})")
            comparisons.append(GoodputComparison(str(name), c["split"], c["mixed"]))
        if not slos or not comparisons:
            raise ValueError(f"spec {where}: goodput needs at least one entry in `slos` and in `comparisons`")
        return cls(tuple(slos), tuple(comparisons), float(margin))


def goodput_per_gpu(summary: Mapping[str, Any], requests: pd.DataFrame, slo: Mapping[str, Any]) -> float:
    return goodput(requests, float(summary["duration_s"]), slo, int(summary.get("num_gpus") or 1))


def goodput_rows(spec: GoodputSpec, runs: Mapping[str, Mapping[str, tuple]]) -> list[dict[str, Any]]:
    """One row per comparison x SLO x backend: both deployments' goodput per GPU, their ratio
    (split / mixed), whether the split beats mixed, and whether that is the SLO's claim. `runs`:
    scenario -> backend -> (summary, requests, ...), as `Fidelity.results` holds them."""
    rows = []
    for comp in spec.comparisons:
        if comp.split not in runs or comp.mixed not in runs:
            continue
        for slo in spec.slos:
            for backend in BACKENDS:
                split = goodput_per_gpu(*runs[comp.split][backend][:2], slo.slo)
                mixed = goodput_per_gpu(*runs[comp.mixed][backend][:2], slo.slo)
                ratio = split / mixed if mixed > 0 else (math.inf if split > 0 else math.nan)
                beats = None if math.isnan(ratio) else bool(ratio > 1 + spec.margin)  # nan: neither meets the SLO
                rows.append({"comparison": comp.name, "slo": slo.name, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s,
                             "backend": backend, "split_per_gpu": split, "mixed_per_gpu": mixed, "ratio": ratio,
                             "split_beats": beats,
                             "claim_holds": None if slo.split_wins is None or beats is None else beats == slo.split_wins})
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:g} ms"


def _yes_no(b: bool | float | None, no: str = "no") -> str:
    """A verdict cell: "-" for None or nan (no request met the SLO)."""
    return "-" if b is None or b != b else ("yes" if b else no)


def goodput_markdown(spec: GoodputSpec, rows: list[dict[str, Any]]) -> str:
    """Per comparison and SLO: the engine's and the simulator's goodput per GPU side by side."""
    lines = ["| comparison | SLO (TTFT, TPOT) | split / GPU (engine / sim) | mixed / GPU (engine / sim) | "
             "split / mixed (engine / sim) | split beats mixed (engine / sim) | claim |",
             "|---|---|---:|---:|---:|:---:|---|"]
    table = pd.DataFrame(rows)
    for (comp, slo_name), g in (table.groupby(["comparison", "slo"], sort=False) if len(table) else ()):
        e, s = (g[g["backend"] == b].iloc[0] for b in BACKENDS)
        slo = next(x for x in spec.slos if x.name == slo_name)
        claim = "-" if slo.split_wins is None else ("split wins" if slo.split_wins else "split does not win")
        verdict = "-" if slo.split_wins is None else (f"{claim}: engine {_yes_no(e['claim_holds'], 'NO')}, "
                                                      f"sim {_yes_no(s['claim_holds'], 'NO')}")
        lines.append(f"| {comp} | {slo_name} ({_ms(slo.ttft_s)}, {_ms(slo.tpot_s)}) | "
                     f"{e['split_per_gpu']:.1f} / {s['split_per_gpu']:.1f} | {e['mixed_per_gpu']:.1f} / "
                     f"{s['mixed_per_gpu']:.1f} | {e['ratio']:.2f} / {s['ratio']:.2f} | "
                     f"{_yes_no(e['split_beats'])} / {_yes_no(s['split_beats'])} | {verdict} |")
    lines.append("")
    lines.append(f"Goodput per GPU: finished requests meeting both SLOs per second per GPU (req/s). The split "
                 f"beats mixed when its goodput per GPU exceeds mixed's by more than {spec.margin:.0%}; claim: "
                 "whether that matches DistServe's (the split wins under a tight TPOT SLO, not under a loose one); -: "
                 "neither deployment had a request meeting the SLO.")
    return "\n".join(lines) + "\n"
