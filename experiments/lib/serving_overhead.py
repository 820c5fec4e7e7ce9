"""The serving path a step's price leaves out (`serving` in conf/config.yaml), added by `backend=sim`.

A client of the HTTP server sees each token later than the engine makes it: the request is parsed
and handed to the engine, the first chunk goes back through the front end (`ttft_overhead_s`), and
under load each later token may come a little slower than in-process (`itl_overhead_s`: added to
every inter-token gap of a request, so it accumulates along the request, as a slower step does).
Both are measured, not fitted: `experiments.bench_online` takes them at one load (server minus
in-process: TTFT p50, mean TPOT) and predicts the others with them. Defaults 0: the engine's own
latencies, as every run had before.

The simulated schedule is not changed (the server's engine schedules as the simulated one does);
only each request row's client-side times are: first token + ttft, token j + ttft + j * itl, the end
with the last token, and TTFT, TPOT and E2E with them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class ServingOverhead:
    ttft_s: float = 0.0
    itl_s: float = 0.0

    @classmethod
    def from_cfg(cls, cfg: Any) -> ServingOverhead:
        section = cfg.get("serving") or {}
        values = {}
        for key in ("ttft_overhead_s", "itl_overhead_s"):
            v = section.get(key, 0.0)
            if v is None:
                v = 0.0
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"serving.{key}={v!r} is invalid: a number of seconds >= 0 (0 = none)")
            values[key] = float(v)
        return cls(values["ttft_overhead_s"], values["itl_overhead_s"])

    @property
    def is_zero(self) -> bool:
        return self.ttft_s == 0.0 and self.itl_s == 0.0

    def apply(self, rows: list[dict]) -> None:
        """Shift every request row's client-side times in place (REQUEST_COLUMNS rows)."""
        if self.is_zero:
            return
        ttft, itl = self.ttft_s, self.itl_s
        for row in rows:
            times = row["token_times"]
            if row["first_token_time"] is None or not times:
                continue  # no token reached the client: nothing to delay
            row["token_times"] = [t + ttft + j * itl for j, t in enumerate(times)]
            end_shift = ttft + (len(times) - 1) * itl
            row["first_token_time"] += ttft
            row["ttft"] += ttft
            row["finish_time"] += end_shift
            row["e2e"] += end_shift
            if row["tpot"] is not None:
                row["tpot"] += itl
