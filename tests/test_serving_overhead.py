"""`serving.ttft_overhead_s` / `serving.itl_overhead_s`: backend=sim adds the HTTP path's measured
delay to every request's client-side times (experiments/lib/serving_overhead.py); 0 changes nothing."""
import pytest
from hydra import compose, initialize_config_module

from experiments.lib.serving_overhead import ServingOverhead
from experiments.lib.traces import load_run
from experiments.run import run

SMALL = ["workload.num_requests=30", "progress=false", "plots=false", "seed=3"]


def _cfg(*overrides):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=[*SMALL, *overrides])


def test_the_term_shifts_each_request_and_nothing_else(tmp_path):
    base = run(_cfg(), tmp_path / "base", "base")
    shifted = run(_cfg("serving.ttft_overhead_s=0.002", "serving.itl_overhead_s=0.0005"), tmp_path / "s", "s")
    assert shifted["run"]["serving_overhead"] == {"ttft_overhead_s": 0.002, "itl_overhead_s": 0.0005}
    a = load_run(tmp_path / "base").requests.set_index("request_id")
    b = load_run(tmp_path / "s").requests.set_index("request_id").loc[a.index]
    assert (b["ttft"] - a["ttft"]).between(0.002 - 1e-9, 0.002 + 1e-9).all()
    assert (b["tpot"] - a["tpot"]).dropna().between(0.0005 - 1e-9, 0.0005 + 1e-9).all()
    lens = a["token_times"].map(len)
    assert ((b["e2e"] - a["e2e"]) - (0.002 + (lens - 1) * 0.0005)).abs().max() < 1e-9
    for (_, ra), (_, rb) in zip(a.iterrows(), b.iterrows()):
        gaps = [y - x for x, y in zip(ra["token_times"], ra["token_times"][1:])]
        gaps_b = [y - x for x, y in zip(rb["token_times"], rb["token_times"][1:])]
        assert gaps_b == pytest.approx([g + 0.0005 for g in gaps], abs=1e-9)
    # The schedule is the same: the simulated steps and queueing do not move.
    assert (b["queueing_time"] == a["queueing_time"]).all()
    assert load_run(tmp_path / "base").steps.equals(load_run(tmp_path / "s").steps)
    assert base["ttft"]["mean"] + 0.002 == pytest.approx(shifted["ttft"]["mean"], abs=1e-9)
    assert "serving_overhead" not in base["run"]


@pytest.mark.parametrize("value", [-0.001, "fast", float("nan")])
def test_a_bad_term_names_its_key(value):
    with pytest.raises(ValueError, match="serving.itl_overhead_s"):
        ServingOverhead.from_cfg({"serving": {"ttft_overhead_s": 0.0, "itl_overhead_s": value}})


def test_no_term_is_no_change():
    rows = [{"first_token_time": 1.0, "ttft": 0.5, "token_times": [1.0, 1.1], "finish_time": 1.1, "e2e": 0.6,
             "tpot": 0.1}]
    before = [dict(r) for r in rows]
    ServingOverhead.from_cfg({}).apply(rows)
    assert rows == before
