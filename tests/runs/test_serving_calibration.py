"""The serving path's terms from served requests (experiments/lib/serving_calibration.py): the
front end's delay per open stream and its jitter from client vs server TTFT, the constant from
client vs in-process TTFT; requests are paired by their lengths and never paired wrongly."""
import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_module

from engine.online.engine_stats import RequestStats
from experiments.lib.serving_calibration import calibrate, front_end_delays
from experiments.lib.serving_overhead import ServingOverhead, open_streams

BASE, PER_STREAM, HAND_OFF = 0.002, 30e-6, 0.0003


def served(seed: int, rate: float, num: int = 300):
    """Client rows and server records of a Poisson stream whose front-end delay is known: BASE +
    PER_STREAM x open streams + uniform jitter of +-0.5 ms. Returns (rows, stats, delays)."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, num))
    server_ttft = rng.uniform(0.005, 0.012, num)
    output_len = rng.integers(100, 1024, num)
    prompt_len = rng.integers(100, 1024, num)
    first = arrival + server_ttft + BASE  # the streams are counted on the client's first tokens
    finish = first + output_len * 0.002
    streams = open_streams(first, finish)
    delay = BASE + PER_STREAM * streams + rng.uniform(-5e-4, 5e-4, num)
    ttft = server_ttft + delay
    rows = pd.DataFrame({"request_id": [f"r{seed}-{i}" for i in range(num)], "status": "finished",
                         "prompt_len": prompt_len, "output_len": output_len, "first_token_time": arrival + ttft,
                         "finish_time": finish, "ttft": ttft})
    stats = [RequestStats(f"cmpl-{i}", "length", int(p), int(n), float(t), [], 1.0)
             for i, (p, n, t) in enumerate(zip(prompt_len, output_len, server_ttft))]
    return rows, stats, delay


def test_requests_pair_by_their_lengths_and_clashes_are_dropped():
    rows, stats, delay = served(0, 20.0, 50)
    rows.loc[3, ["prompt_len", "output_len"]] = rows.loc[4, ["prompt_len", "output_len"]].to_numpy()
    stats[3] = RequestStats("cmpl-3", "length", int(rows.loc[3, "prompt_len"]), int(rows.loc[3, "output_len"]),
                            stats[3].ttft, [], 1.0)
    stats.append(RequestStats("cmpl-x", "abort:user", 5, 5, 0.1, [], 1.0))  # not finished: ignored
    d = front_end_delays(rows, reversed(stats)).set_index("request_id")
    assert len(d) == 48 and "r0-3" not in d.index and "r0-4" not in d.index
    keep = [i for i in range(50) if i not in (3, 4)]
    assert d.loc[[f"r0-{i}" for i in keep], "delay"].to_numpy() == pytest.approx(delay[keep])


def test_the_fit_recovers_the_front_end_and_the_constant():
    points = {"low": served(1, 12.0)[:2], "high": served(2, 30.0)[:2]}
    client = points["low"][0]
    rng = np.random.default_rng(3)
    stats_ttft = {(s.num_prompt_tokens, s.num_generation_tokens): s.ttft for s in points["low"][1]}
    # The in-process engine ran the low stream: its TTFT is the server's less the hand-off, with
    # each arrival's place among the steps varying by up to a step either way (zero mean).
    engine_ttft = [stats_ttft[(p, n)] - HAND_OFF + rng.uniform(-0.002, 0.002)
                   for p, n in zip(client["prompt_len"], client["output_len"])]
    engine = pd.DataFrame({"request_id": client["request_id"], "ttft": engine_ttft})
    c = calibrate(points, "low", engine, itl_overhead_s=-1e-5)
    assert c.num_samples == 600
    assert c.ttft_per_stream_s == pytest.approx(PER_STREAM, abs=5e-6)
    assert c.front_end_intercept_s == pytest.approx(BASE, abs=2e-4)
    assert c.hand_off_s == pytest.approx(HAND_OFF, abs=2.5e-4)
    assert c.ttft_overhead_s == pytest.approx(BASE + HAND_OFF, abs=2.5e-4)
    assert c.itl_overhead_s == 0.0  # a negative difference is no overhead
    # The jitter is the uniform residual: quantiles from -0.5 ms to +0.5 ms, mean 0.
    levels = (np.arange(20) + 0.5) / 20
    assert c.ttft_jitter_s == pytest.approx(-5e-4 + levels * 1e-3, abs=1e-4)
    assert c.mean_streams["high"] > 2 * c.mean_streams["low"] > 0


def test_the_calibration_is_the_model_a_sim_run_reads():
    points = {"low": served(4, 15.0, 60)[:2]}
    engine = points["low"][0][["request_id", "ttft"]].assign(ttft=lambda d: d["ttft"] - 0.003)
    c = calibrate(points, "low", engine, itl_overhead_s=2e-5)
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*c.overrides(), "seed=5"])
    read = ServingOverhead.from_cfg(cfg)
    assert read.seed == 5 and read.itl_s == pytest.approx(2e-5)
    model = c.model(seed=5)
    assert read.ttft_s == pytest.approx(model.ttft_s, rel=1e-5)
    assert read.per_stream_s == pytest.approx(model.per_stream_s, rel=1e-5)
    assert read.jitter_s == pytest.approx(model.jitter_s, rel=1e-5, abs=1e-12)


def test_too_few_matched_requests_is_a_clear_error():
    rows, stats, _ = served(6, 10.0, 5)
    with pytest.raises(ValueError, match="0 matched request"):
        calibrate({"low": (rows, stats[:0])}, "low", rows[["request_id", "ttft"]], 0.0)
