"""The serving path's terms (experiments/lib/serving_overhead.py) measured from served requests.

Two measurements of each served request, at calibration loads that are not the loads predicted:
- the client's TTFT (`experiments.bench_serving`'s rows: from the send to the first chunk read);
- the server's own TTFT (`AsyncLLMEngine.add_finished_observer`'s `RequestStats`: from `generate()`
  to the first token leaving the step that made it, on the server's clock).
Their difference is the front end's part of that request's delay (HTTP in, chunk out), free of
where the arrival fell among the steps (both sides saw the same step). A client row and a server
record are the same request when their (prompt tokens, output tokens) agree and no other request
has the same pair (a workload's lengths are drawn independently: a clash drops both, never pairs
them wrongly). Least squares over every calibration request gives

    front-end delay = intercept + ttft_per_stream_s * (streams open at the first token) + residual

and the residuals' quantiles are the jitter. What the server's TTFT itself holds beyond the
engine's (the hand-off to the core process, the step's outputs processed there) is measured at the
load where the in-process engine ran the same stream: the mean of client minus in-process TTFT over
the requests there (a mean, so where each arrival fell among the steps averages out) fixes the
constant, `ttft_overhead_s` = that mean - ttft_per_stream_s * the mean streams there.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from experiments.lib.serving_overhead import ServingOverhead, open_streams

JITTER_LEVELS = 20  # quantiles of the residuals kept (levels (k + 0.5) / 20)


@dataclass(slots=True)
class Calibration:
    ttft_overhead_s: float
    ttft_per_stream_s: float
    ttft_jitter_s: list[float]
    itl_overhead_s: float
    front_end_intercept_s: float  # the least-squares intercept of client minus server TTFT
    hand_off_s: float  # ttft_overhead_s - front_end_intercept_s: in the server, beyond the engine
    num_samples: int  # matched requests in the fit
    mean_streams: dict[str, float] = field(default_factory=dict)  # per calibration load

    def model(self, seed: int = 0) -> ServingOverhead:
        return ServingOverhead(self.ttft_overhead_s, self.ttft_per_stream_s, tuple(self.ttft_jitter_s),
                               self.itl_overhead_s, seed)

    def overrides(self) -> list[str]:
        """Hydra overrides of conf/config.yaml's `serving` section."""
        jitter = ",".join(f"{v:.6g}" for v in self.ttft_jitter_s)
        return [f"serving.ttft_overhead_s={self.ttft_overhead_s:.6g}",
                f"serving.ttft_per_stream_s={self.ttft_per_stream_s:.6g}",
                f"serving.ttft_jitter_s=[{jitter}]", f"serving.itl_overhead_s={self.itl_overhead_s:.6g}"]


def with_streams(rows: pd.DataFrame) -> pd.DataFrame:
    """The finished rows with a first token, with `streams`: others streaming at that first token."""
    done = rows[(rows["status"] == "finished") & rows["first_token_time"].notna()].copy()
    done["streams"] = open_streams(done["first_token_time"].to_numpy(float), done["finish_time"].to_numpy(float))
    return done


def front_end_delays(client_rows: pd.DataFrame, server: Iterable[Any]) -> pd.DataFrame:
    """Client rows matched with the server's RequestStats: `request_id`, `streams`, `client_ttft`,
    `server_ttft`, `delay` (client minus server)."""
    done = with_streams(client_rows)
    records = [s for s in server if s.ttft is not None and s.finish_reason in ("stop", "length")]
    server_keys = Counter((s.num_prompt_tokens, s.num_generation_tokens) for s in records)
    by_key = {(s.num_prompt_tokens, s.num_generation_tokens): s.ttft for s in records}
    keys = list(zip(done["prompt_len"].astype(int), done["output_len"].astype(int)))
    client_keys = Counter(keys)
    unique = [client_keys[k] == 1 and server_keys.get(k) == 1 for k in keys]
    matched = done[unique]
    server_ttft = [by_key[k] for k, ok in zip(keys, unique) if ok]
    return pd.DataFrame({"request_id": matched["request_id"].to_numpy(), "streams": matched["streams"].to_numpy(),
                         "client_ttft": matched["ttft"].to_numpy(float), "server_ttft": np.asarray(server_ttft, float),
                         "delay": matched["ttft"].to_numpy(float) - np.asarray(server_ttft, float)})


def fit_front_end(delays: pd.DataFrame) -> tuple[float, float, list[float]]:
    """(intercept, per-stream slope >= 0, residual quantiles) of delay against streams."""
    if len(delays) < 2:
        raise ValueError(f"{len(delays)} matched request(s) to calibrate the serving path from: need 2 or more")
    x, y = delays["streams"].to_numpy(float), delays["delay"].to_numpy(float)
    spread = float(np.var(x))
    slope = max(float(np.cov(x, y, bias=True)[0, 1]) / spread, 0.0) if spread > 0 else 0.0
    intercept = float(y.mean() - slope * x.mean())
    residuals = y - intercept - slope * x
    levels = (np.arange(JITTER_LEVELS) + 0.5) / JITTER_LEVELS
    return intercept, slope, [float(q) for q in np.quantile(residuals, levels)]


def calibrate(points: dict[str, tuple[pd.DataFrame, list[Any]]], level: str, in_process_rows: pd.DataFrame,
              itl_overhead_s: float) -> Calibration:
    """points: calibration load -> (the server run's client rows, the server's RequestStats of it);
    level: the point whose stream the in-process engine also ran (`in_process_rows`)."""
    delays = pd.concat([front_end_delays(rows, stats) for rows, stats in points.values()], ignore_index=True)
    intercept, slope, jitter = fit_front_end(delays)
    client = with_streams(points[level][0]).set_index("request_id")
    engine = in_process_rows[in_process_rows["ttft"].notna()].set_index("request_id")
    both = client.index.intersection(engine.index)
    if len(both) == 0:
        raise ValueError(f"the calibration point {level!r} and the in-process run share no finished request")
    diff = float((client.loc[both, "ttft"] - engine.loc[both, "ttft"]).mean())
    constant = max(diff - slope * float(client.loc[both, "streams"].mean()), 0.0)
    means = {name: float(with_streams(rows)["streams"].mean()) for name, (rows, _) in points.items()}
    return Calibration(constant, slope, jitter, max(itl_overhead_s, 0.0), intercept, constant - intercept,
                       len(delays), means)
