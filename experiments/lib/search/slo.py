"""The SLOs a deployment must meet at a rate: TTFT and TPOT percentiles, or a goodput fraction."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from experiments.lib.metrics import check_slo_seconds, meets_slo


@dataclass(slots=True, frozen=True)
class SearchSlo:
    ttft_s: float | None = 2.0
    ttft_percentile: float = 90.0
    tpot_s: float | None = 0.05
    tpot_percentile: float = 90.0
    goodput: float | None = None  # share of requests meeting ttft_s and tpot_s both; None: percentiles

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SearchSlo:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"search.slo.{sorted(unknown)[0]} is unknown: allowed are {sorted(cls.__dataclass_fields__)}")
        slo = cls(**d)
        for key in ("ttft_s", "tpot_s"):
            check_slo_seconds(getattr(slo, key), f"search.slo.{key}")
        for key in ("ttft_percentile", "tpot_percentile"):
            v = getattr(slo, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 100:
                raise ValueError(f"search.slo.{key}={v!r} is invalid: must be in (0, 100]")
        g = slo.goodput
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1):
            raise ValueError(f"search.slo.goodput={g!r} is invalid: must be a fraction in (0, 1] or null")
        if slo.ttft_s is None and slo.tpot_s is None:
            raise ValueError("search.slo sets no objective: give ttft_s or tpot_s (or both)")
        return slo

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check(self, requests: pd.DataFrame) -> tuple[bool, dict[str, float | None], list[str]]:
        """(met, measured metrics, the search.slo fields missed) over one run's request rows; an
        aborted or unfinished request misses every objective."""
        done = requests[requests["status"] == "finished"]
        n = max(len(requests), 1)
        ok_rows = meets_slo(done, {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s})
        metrics: dict[str, float | None] = {"goodput_fraction": float(ok_rows.sum()) / n,
                                            "completed_fraction": len(done) / n,
                                            "ttft_p": _percentile(done["ttft"], self.ttft_percentile),
                                            "tpot_p": _percentile(done["tpot"].fillna(0.0), self.tpot_percentile)}
        missed = []
        if self.goodput is not None:
            if metrics["goodput_fraction"] < self.goodput:
                missed.append("goodput")
        else:
            if len(done) < len(requests):
                missed.append("completed")
            if self.ttft_s is not None and not (metrics["ttft_p"] is not None and metrics["ttft_p"] <= self.ttft_s):
                missed.append("ttft_s")
            if self.tpot_s is not None and not (metrics["tpot_p"] is not None and metrics["tpot_p"] <= self.tpot_s):
                missed.append("tpot_s")
        return not missed, metrics, missed

    def explain(self, requests: pd.DataFrame, metrics: Mapping[str, float | None], missed: list[str]) -> str:
        """Why a run missed (empty when it met), with its figures: each objective missed against its
        limit, the requests that did not finish by their finish reason and, for goodput, which
        objective the finished ones missed ("goodput 0.858 < 0.9: 43 of 304 requests not finished
        (43 abort:handoff_queue_full)")."""
        if not missed:
            return ""
        parts = []
        for key in missed:
            if key == "ttft_s":
                parts.append(_over("TTFT", self.ttft_percentile, metrics["ttft_p"], self.ttft_s, "s", 1.0))
            elif key == "tpot_s":
                parts.append(_over("TPOT", self.tpot_percentile, metrics["tpot_p"], self.tpot_s, "ms", 1e3))
            elif key == "goodput":
                parts.append(f"goodput {metrics['goodput_fraction']:.3g} < {self.goodput:g}")
        done = requests[requests["status"] == "finished"]
        if len(done) < len(requests):
            left = requests[requests["status"] != "finished"]
            why = left["finish_reason"].fillna(left["status"]).fillna("unfinished").value_counts()
            parts.append(f"{len(left)} of {len(requests)} requests not finished ("
                         + ", ".join(f"{n} {reason}" for reason, n in why.items()) + ")")
        if "goodput" in missed:
            for key, label, unit, scale in (("ttft_s", "TTFT", "s", 1.0), ("tpot_s", "TPOT", "ms", 1e3)):
                limit = getattr(self, key)
                if limit is not None:
                    over = int((~meets_slo(done, {key: limit})).sum())
                    parts.append(f"{over} finished over {label} {limit * scale:g} {unit}")
        return "; ".join(parts)


def _over(label: str, percentile: float, value: float | None, limit: float, unit: str, scale: float) -> str:
    if value is None:
        return f"{label}: no request finished"
    return f"{label} p{percentile:g} {value * scale:.3g} {unit} > {limit * scale:g} {unit}"


def _percentile(values: pd.Series, q: float) -> float | None:
    v = values.to_numpy(dtype=float)
    v = v[~np.isnan(v)]
    return float(np.percentile(v, q)) if v.size else None
