"""The serving path a step's price leaves out (`serving` in conf/config.yaml), added by `backend=sim`.

A client of the HTTP server sees each token later than the engine makes it. What lies between:
- in: the client's send, HTTP parsing and validation, the hand-off to the engine (core process);
- out: the step's outputs processed, packed and sent to the front end, each stream's chunk built and
  written, and the client reading it. Each step brings one chunk per open stream, and one event loop
  (the server's, then the client's) handles them one after the other, so a request's first chunk
  waits behind the chunks of the streams open at that moment, and the HTTP request of one that
  arrives waits behind them too.

So the client's delay of request i's first token is modelled as

    delay_i = ttft_overhead_s + ttft_per_stream_s * n_i + jitter_i

n_i: the streams open when its first token is made (requests whose first token came before and whose
last one comes after it: `open_streams`, computed the same way on the simulator's rows as on the
client's); jitter_i: what the two terms leave, a distribution (`ttft_jitter_s`: its quantiles at
levels (k + 0.5) / K, mean about 0: event-loop and thread hand-off timing, the stream's place among
the step's chunks). Each request draws its jitter by stratified sampling (the requests, in an order
shuffled with the run's seed, take the levels (r + 0.5) / N), so the run's jitter has the measured
distribution and is independent of the simulated TTFT, and the same seed gives the same run.
Later tokens: + `itl_overhead_s` per inter-token gap (a slower step under load accumulates along the
request). Every term is measured, none fitted to the loads predicted: `experiments.bench_online`
takes them from served requests at calibration loads (experiments/lib/serving_calibration.py).

Why all of it is added to the client's times and none delays the arrival the simulator sees: a delay
every request has in common moves the whole simulation in time (the scheduler only sees differences
of times), so it adds exactly to each TTFT; only the variation between requests could move one into
another step, and that varies the wait by a fraction of a step either way, as an arrival's position
within a step already does (tests/runs/test_serving_overhead.py checks the translation).

The simulated schedule is not changed; only each request row's client-side times are: token j at
its simulated time + delay_i + j * itl, the end with the last token, and TTFT, TPOT and E2E with them.
Defaults 0 and no jitter: the engine's own latencies.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SCALARS = ("ttft_overhead_s", "ttft_per_stream_s", "itl_overhead_s")


def _seconds(key: str, v: Any) -> float:
    if v is None:
        return 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"serving.{key}={v!r} is invalid: a number of seconds")
    return float(v)


@dataclass(slots=True, frozen=True)
class ServingOverhead:
    ttft_s: float = 0.0  # every first token
    per_stream_s: float = 0.0  # per stream open when the first token is made
    jitter_s: tuple[float, ...] = ()  # quantiles at levels (k + 0.5) / K, ascending
    itl_s: float = 0.0  # every later inter-token gap
    seed: int = 0  # the jitter's draw

    def __post_init__(self) -> None:
        for key, v in zip(SCALARS, (self.ttft_s, self.per_stream_s, self.itl_s)):
            if _seconds(key, v) < 0:
                raise ValueError(f"serving.{key}={v!r} is invalid: a number of seconds >= 0 (0 = none)")
        for v in self.jitter_s:
            _seconds("ttft_jitter_s", v)
        if list(self.jitter_s) != sorted(self.jitter_s):
            raise ValueError(f"serving.ttft_jitter_s={list(self.jitter_s)!r} is invalid: quantiles must "
                             "be in ascending order")

    @classmethod
    def from_cfg(cls, cfg: Any) -> ServingOverhead:
        section = cfg.get("serving") or {}
        values = [_seconds(key, section.get(key, 0.0)) for key in SCALARS]
        jitter = section.get("ttft_jitter_s") or ()
        if isinstance(jitter, (str, bytes)) or not isinstance(jitter, Sequence):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                f"serving.ttft_jitter_s={jitter!r} is invalid: a list of seconds (quantiles)")
        seed = cfg.get("seed", 0)
        return cls(values[0], values[1], tuple(_seconds("ttft_jitter_s", v) for v in jitter), values[2],
                   int(seed) if seed is not None else 0)

    @property
    def is_zero(self) -> bool:
        return self.ttft_s == 0.0 and self.per_stream_s == 0.0 and not any(self.jitter_s) and self.itl_s == 0.0

    def describe(self) -> dict[str, Any]:
        """The terms as `summary.json`'s `run.serving_overhead` records them."""
        return {"ttft_overhead_s": self.ttft_s, "ttft_per_stream_s": self.per_stream_s,
                "ttft_jitter_s": list(self.jitter_s), "itl_overhead_s": self.itl_s}

    def delays(self, rows: list[dict]) -> list[float | None]:
        """Each row's first-token delay (None for a row without a first token)."""
        firsts = [r["first_token_time"] if len(r["token_times"]) else None for r in rows]
        timed = [i for i, t in enumerate(firsts) if t is not None]
        out: list[float | None] = [None] * len(rows)
        if not timed:
            return out
        streams = open_streams([firsts[i] for i in timed], [rows[i]["finish_time"] for i in timed])
        jitter = self.jitter(len(timed))
        for k, i in enumerate(timed):
            out[i] = max(self.ttft_s + self.per_stream_s * streams[k] + jitter[k], 0.0)
        return out

    def jitter(self, n: int) -> np.ndarray:
        """n draws of the jitter, stratified over its quantiles in a seeded order."""
        if not self.jitter_s or n == 0:
            return np.zeros(n)
        levels = (np.arange(len(self.jitter_s)) + 0.5) / len(self.jitter_s)
        ranks = np.random.default_rng(self.seed).permutation(n)
        return np.interp((ranks + 0.5) / n, levels, np.asarray(self.jitter_s))

    def apply(self, rows: list[dict]) -> None:
        """Shift every request row's client-side times in place (REQUEST_COLUMNS rows)."""
        if self.is_zero:
            return
        itl = self.itl_s
        for row, delay in zip(rows, self.delays(rows)):
            if delay is None:
                continue  # no token reached the client: nothing to delay
            times = row["token_times"]
            row["token_times"] = [t + delay + j * itl for j, t in enumerate(times)]
            end_shift = delay + (len(times) - 1) * itl
            row["first_token_time"] += delay
            row["ttft"] += delay
            row["finish_time"] += end_shift
            row["e2e"] += end_shift
            if row["tpot"] is not None:
                row["tpot"] += itl


def open_streams(first_token_times: Sequence[float], finish_times: Sequence[float]) -> np.ndarray:
    """For each request, how many others stream when its first token is made: first token at or
    before it, end after it."""
    first = np.asarray(first_token_times, dtype=float)
    finish = np.asarray(finish_times, dtype=float)
    started = np.searchsorted(np.sort(first), first, side="right")  # itself included
    ended = np.searchsorted(np.sort(finish), first, side="right")  # itself included when it ends at once
    return started - ended - (finish > first)
