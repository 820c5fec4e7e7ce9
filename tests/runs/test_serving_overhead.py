"""The serving path `backend=sim` adds to every request's client-side times
(experiments/lib/serving_overhead.py): a constant, a term per stream open at the first token, a
jitter drawn from measured quantiles, an ITL term; nothing set changes nothing, and the schedule
never moves."""
import numpy as np
import pytest
from hydra import compose, initialize_config_module
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples

from experiments.lib.run_workload import run
from experiments.lib.serving_overhead import ServingOverhead, open_streams
from experiments.lib.traces import load_run
from sim import Simulator
from tests.simulation.test_sim import Constant, request, scheduler

SMALL = ["workload.num_requests=30", "progress=false", "plots=false", "seed=3"]


def _cfg(*overrides):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=[*SMALL, *overrides])


def test_the_terms_shift_each_request_and_nothing_else(tmp_path):
    base = run(_cfg(), tmp_path / "base", "base")
    terms = ["serving.ttft_overhead_s=0.002", "serving.ttft_per_stream_s=0.0001",
             "serving.ttft_jitter_s=[-0.0005,0,0.0005]", "serving.itl_overhead_s=0.0005"]
    shifted = run(_cfg(*terms), tmp_path / "s", "s")
    assert shifted["run"]["serving_overhead"] == {
        "ttft_overhead_s": 0.002, "ttft_per_stream_s": 0.0001, "ttft_jitter_s": [-0.0005, 0.0, 0.0005],
        "itl_overhead_s": 0.0005}
    a = load_run(tmp_path / "base").requests.set_index("request_id")
    b = load_run(tmp_path / "s").requests.set_index("request_id").loc[a.index]
    model = ServingOverhead.from_cfg(_cfg(*terms))
    delay = np.asarray(model.delays(a.reset_index().to_dict("records")), float)
    assert (b["ttft"] - a["ttft"]).to_numpy() == pytest.approx(delay, abs=1e-9)
    streams = open_streams(a["first_token_time"], a["finish_time"])
    assert streams.max() > 0  # the per-stream term is exercised
    jitter = delay - 0.002 - 0.0001 * streams
    assert jitter.min() >= -0.0005 - 1e-9 and jitter.max() <= 0.0005 + 1e-9 and np.ptp(jitter) > 0
    assert (b["tpot"] - a["tpot"]).dropna().between(0.0005 - 1e-9, 0.0005 + 1e-9).all()
    lens = a["token_times"].map(len).to_numpy()
    assert ((b["e2e"] - a["e2e"]).to_numpy() - (delay + (lens - 1) * 0.0005)) == pytest.approx(0, abs=1e-9)
    for (_, ra), (_, rb) in zip(a.iterrows(), b.iterrows()):
        gaps = np.diff(ra["token_times"])
        assert np.diff(rb["token_times"]) == pytest.approx(gaps + 0.0005, abs=1e-9)
    # The schedule is the same: the simulated steps and queueing do not move.
    assert (b["queueing_time"] == a["queueing_time"]).all()
    assert load_run(tmp_path / "base").steps.equals(load_run(tmp_path / "s").steps)
    assert "serving_overhead" not in base["run"]


def test_open_streams_counts_the_others_streaming_at_a_first_token():
    # a streams 0-10, b 2-5, c 5-8 (its first token as b ends), d 9-9 (one token), e 12-13.
    first = [0.0, 2.0, 5.0, 9.0, 12.0]
    finish = [10.0, 5.0, 8.0, 9.0, 13.0]
    assert open_streams(first, finish).tolist() == [0, 1, 1, 1, 0]


@settings(max_examples=examples(50), deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 10)), min_size=1, max_size=40))
def test_open_streams_agrees_with_counting_by_hand(spans):
    first = [s for s, _ in spans]
    finish = [s + d for s, d in spans]
    expected = [sum(1 for j in range(len(spans)) if j != i and first[j] <= first[i] < finish[j])
                for i in range(len(spans))]
    assert open_streams(first, finish).tolist() == expected


def test_the_jitter_draw_has_the_measured_quantiles_and_follows_the_seed():
    quantiles = tuple(float(q) for q in np.linspace(-1e-3, 2e-3, 20))
    draw = ServingOverhead(jitter_s=quantiles, seed=7).jitter(200)
    # Stratified: 10 requests per quantile level, so the run's own quantiles are the measured ones.
    levels = (np.arange(20) + 0.5) / 20
    assert np.quantile(np.sort(draw), levels) == pytest.approx(quantiles, abs=2e-4)
    assert draw.mean() == pytest.approx(np.mean(quantiles), abs=1e-5)
    assert (draw == ServingOverhead(jitter_s=quantiles, seed=7).jitter(200)).all()
    other = ServingOverhead(jitter_s=quantiles, seed=8).jitter(200)
    assert not (draw == other).all() and np.sort(draw) == pytest.approx(np.sort(other))


def test_a_common_delay_before_the_engine_only_moves_the_simulation_in_time():
    """Why the serving path is added to the client's times: delaying every arrival by the same d
    (the inbound part common to all) shifts every simulated time by d, TTFT unchanged, so the
    client's TTFT grows by exactly d whichever side of the engine the delay is on."""
    reqs = [("a", 1.0, 40, 12), ("b", 1.013, 300, 6), ("c", 1.0205, 20, 9), ("d", 1.04, 64, 4)]
    rows = {}
    for shift in (0.0, 0.0037):
        sched = scheduler(async_scheduling=True, max_num_batched_tokens=256)
        Simulator(sched, Constant(0.004), [request(rid, t + shift, p, n) for rid, t, p, n in reqs]).run()
        rows[shift] = {r["request_id"]: r for r in sched.recorder.requests}
    for rid, *_ in reqs:
        a, b = rows[0.0][rid], rows[0.0037][rid]
        assert b["ttft"] == pytest.approx(a["ttft"], abs=1e-9)
        assert b["token_times"] == pytest.approx([t + 0.0037 for t in a["token_times"]], abs=1e-9)


@pytest.mark.parametrize(("key", "value"), [("itl_overhead_s", -0.001), ("itl_overhead_s", "fast"),
                                            ("ttft_per_stream_s", float("nan")), ("ttft_jitter_s", "0.1"),
                                            ("ttft_jitter_s", [0.2, 0.1]), ("ttft_jitter_s", [0.0, "x"])])
def test_a_bad_term_names_its_key(key, value):
    with pytest.raises(ValueError, match=f"serving.{key}"):
        ServingOverhead.from_cfg({"serving": {key: value}})


def test_no_term_is_no_change():
    rows = [{"first_token_time": 1.0, "ttft": 0.5, "token_times": [1.0, 1.1], "finish_time": 1.1, "e2e": 0.6,
             "tpot": 0.1}]
    before = [dict(r) for r in rows]
    ServingOverhead.from_cfg({}).apply(rows)
    assert rows == before
