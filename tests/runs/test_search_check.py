"""experiments.search_check (docs/search.md, "Checking the answer"): the bracketing runs around a
predicted capacity, the choice of the neighbour, the rank order on measured brackets, the report,
bad input (one line naming the field) and a search checked against the simulator end to end."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from property_settings import examples

from experiments import search as search_module
from experiments import search_check
from experiments.lib.search.capacity import RateProbe
from experiments.lib.search.check_bracket import Bracket, CheckedProbe, bracket_capacity, rank_order
from experiments.lib.search.check_pick import SearchOutput, choose_neighbour, choose_pick, device_reason
from experiments.lib.search.check_report import Measured, save, write_report

# Qwen3-0.6B on one simulated H200, short requests, 2 s of arrivals per run: two deployments that
# differ in max_num_seqs, and a capacity found within 5% (the check brackets it at +-10%).
TINY = ["model=qwen3-0.6b", "workload=poisson", "workload.prompt_len={dist: uniform, low: 16, high: 64}",
        "workload.output_len={dist: uniform, low: 32, high: 64}", "search.duration_s=2",
        "search.rate.max_iterations=10", "search.rate.growth=2", "search.rate.start_per_replica=4",
        "search.slo.ttft_s=0.2", "search.slo.tpot_s=0.02", "search.space.gpu=[h200]",
        "search.space.tensor_parallel_size=[1]", "search.space.replicas=[1]", "search.space.max_num_seqs=[2,8]",
        "search.space.max_num_batched_tokens=[512]", "search.target_rate=2"]


def engine_like(capacity: float):
    """A deployment whose SLOs hold up to `capacity` req/s, and the rates it was run at."""
    rates: list[float] = []

    def probe(rate: float) -> RateProbe:
        rates.append(rate)
        return RateProbe(rate, rate <= capacity, {"ttft_p": 0.1}, [] if rate <= capacity else ["ttft_s"])
    return probe, rates


@pytest.mark.parametrize("capacity, runs, verdict", [
    (100.0, [90, 110], "within 10%"),
    (95.0, [90, 110], "within 10%"),
    (120.0, [90, 110, 135], "engine capacity +10% to +35% of the prediction"),
    (200.0, [90, 110, 135], "engine above the prediction by >= +35%"),
    (80.0, [90, 65], "engine capacity -35% to -10% of the prediction"),
    (50.0, [90, 65], "engine below the prediction by > 35%"),
])
def test_the_runs_bracket_the_prediction_and_step_out_once(capacity, runs, verdict):
    probe, rates = engine_like(capacity)
    b = bracket_capacity(probe, predicted=100.0, within=0.1, step=0.25, max_steps=1)
    assert rates == pytest.approx(runs)
    assert b.verdict() == verdict
    assert b.is_within == (verdict == "within 10%")


@hyp_settings(max_examples=examples(80), deadline=None)
@given(st.floats(0.01, 1e4), st.floats(0.01, 1e4), st.floats(0.02, 0.5), st.floats(0.05, 0.9), st.integers(0, 3))
def test_the_bracket_holds_the_true_capacity(capacity, predicted, within, step, max_steps):
    """Whatever the prediction, the measured bracket [low, high) contains the capacity, it is
    "within" exactly when the capacity is, and at most 2 + max_steps runs are spent."""
    probe, rates = engine_like(capacity)
    b = bracket_capacity(probe, predicted, within, step, max_steps)
    assert b.low <= capacity < b.high
    assert len(rates) <= 2 + max_steps and b.monotone
    inside = (1 - within) * predicted <= capacity < (1 + within) * predicted
    assert b.is_within == inside


def bracket(low: float, high: float, predicted: float = 10.0) -> Bracket:
    probes = [CheckedProbe(low / predicted, RateProbe(low, True))]
    if math.isfinite(high):
        probes.append(CheckedProbe(high / predicted, RateProbe(high, False, {}, ["ttft_s"])))
    return Bracket(predicted, 0.1, probes)


@pytest.mark.parametrize("pick, neighbour, order", [
    ((bracket(9, 11), 4.0), (bracket(4, 5), 4.0), "kept"),  # same price, capacities apart
    ((bracket(4, 5), 4.0), (bracket(9, 11), 4.0), "reversed"),
    ((bracket(9, 11), 4.0), (bracket(10, 12), 4.0), "undetermined"),  # the brackets overlap
    ((bracket(9, 11), 4.0), (bracket(30, math.inf), 8.0), "kept"),  # cheaper, both reach the target 5
    ((bracket(3, 4), 4.0), (bracket(9, 11), 8.0), "reversed"),  # the pick misses the target on the engine
    ((bracket(5, 6), 8.0), (bracket(4, 5), 4.0), "kept"),  # the cheaper one missed the SLOs at the target
    ((bracket(5, 6), 8.0), (bracket(4, 5.5), 4.0), "undetermined"),  # it may reach the target below 5.5
])
def test_the_rank_order_on_measured_brackets(pick, neighbour, order):
    assert rank_order(pick, neighbour, target=5.0) == order


def table(rows: list[tuple]) -> pd.DataFrame:
    cols = ["gpu", "tensor_parallel_size", "replicas", "max_num_seqs", "max_num_batched_tokens", "policy", "router",
            "dollars_per_hour", "status", "capacity_rps"]
    return pd.DataFrame([dict(zip(cols, r)) for r in rows])


def output(rows: list[tuple], target: float = 5.0, cheapest: bool = True) -> SearchOutput:
    t = table(rows)
    summary = {"model": "qwen3-0.6b", "workload": "poisson", "latency": "roofline", "target_rate": target,
               "cheapest": {} if cheapest else None}
    return SearchOutput(Path("res"), t, summary, OmegaConf.create({"search": {"slo": {"ttft_s": 1.0}, "duration_s": 10}}))


ROWS = [("h200", 1, 1, 64, 2048, "fcfs", "rr", 3.8, "simulated", 20.0),  # the pick
        ("h200", 1, 1, 64, 8192, "fcfs", "rr", 3.8, "simulated", 20.0),  # a tie: not below it
        ("h200", 1, 1, 16, 2048, "fcfs", "rr", 3.8, "simulated", 8.0),  # max_num_seqs, ranks below
        ("h200", 2, 1, 64, 2048, "fcfs", "rr", 7.6, "simulated", 30.0),  # TP: dearer, ranks below
        ("h200", 1, 2, 64, 2048, "fcfs", "rr", 7.6, "simulated", 40.0),  # two replicas: no engine fleet
        ("h200", 1, 1, 64, 2048, "sjf", "rr", 3.8, "pruned", math.nan),
        ("h200", 1, 1, 8, 2048, "fcfs", "rr", 3.8, "simulated", 0.0)]  # no capacity to bracket


def test_the_neighbour_is_the_best_ranked_one_dimension_away():
    out = output(ROWS)
    pick = choose_pick(out, "engine")
    assert (pick["max_num_seqs"], pick["max_num_batched_tokens"]) == (64, 2048)
    assert choose_neighbour(out, pick, "engine")["max_num_seqs"] == 16  # as cheap, reaches 5 req/s: ranks next
    assert choose_neighbour(out, pick, "engine", "tensor_parallel_size")["tensor_parallel_size"] == 2
    assert choose_neighbour(out, pick, "sim", "replicas")["replicas"] == 2  # the simulator runs fleets
    with pytest.raises(ValueError, match=r"no neighbour to check: .* in search.space.replicas .*1 skipped, e.g. "
                                         r".*replicas=2: backend=engine runs one replica"):
        choose_neighbour(out, pick, "engine", "replicas")
    with pytest.raises(ValueError, match=r"--neighbour-dimension='gpus' is unknown"):
        choose_neighbour(out, pick, "engine", "gpus")


def test_a_pick_the_engine_cannot_run_or_no_pick_is_an_error():
    fleet = [("h200", 1, 2, 64, 2048, "fcfs", "rr", 7.6, "simulated", 20.0)]
    with pytest.raises(ValueError, match=r"pick .* cannot be checked: replicas=2: backend=engine runs one replica"):
        choose_pick(output(fleet), "engine")
    with pytest.raises(ValueError, match=r"has no pick: summary.json cheapest=null, no deployment reaches "
                                         r"search.target_rate=50 req/s \(the largest capacity is 40 req/s\)"):
        choose_pick(output(ROWS, target=50.0, cheapest=False), "engine")


@pytest.mark.parametrize("names, tp, match", [
    ([], 1, "needs a GPU and none is visible"),
    (["NVIDIA H200"], 2, "tensor_parallel_size=2 needs 2 GPUs and 1 is visible"),
    (["NVIDIA H100 80GB HBM3"], 1, "gpu='h200' (conf/hardware 'h200') is not the engine's GPU 'NVIDIA H100 80GB HBM3'"),
    (["NVIDIA H200", "NVIDIA H200"], 2, None),
])
def test_a_deployment_the_visible_gpus_cannot_run(names, tp, match):
    reason = device_reason({"gpu": "h200", "tensor_parallel_size": tp}, "h200", names)
    assert reason == match if match is None else match in reason


def test_the_report_merges_separate_runs_and_ignores_other_deployments(tmp_path):
    out = output(ROWS)
    pick = choose_pick(out, "engine")
    rows = {"pick": pick.to_dict(), "neighbour": choose_neighbour(out, pick, "engine", "max_num_seqs").to_dict()}
    probe, _ = engine_like(21.0)
    save(tmp_path, Measured("pick", rows["pick"], bracket_capacity(probe, 20.0), "engine", "NVIDIA H200", 60.0))
    first = write_report(tmp_path, out, rows)  # the neighbour's process has not finished
    assert list(first["verdict"]) == ["within 10%", "not measured"] and (first["rank_order"] == "not measured").all()
    probe, _ = engine_like(6.0)
    save(tmp_path, Measured("neighbour", rows["neighbour"], bracket_capacity(probe, 8.0), "engine", "NVIDIA H200", 50.0))
    frame = write_report(tmp_path, out, rows)
    assert list(frame["verdict"]) == ["within 10%", "engine capacity -35% to -10% of the prediction"]
    assert (frame["rank_order"] == "kept").all()
    assert len(pd.read_csv(tmp_path / "probes.csv")) == 4
    md = (tmp_path / "check.md").read_text()
    assert "**kept**" in md and "NVIDIA H200" in md
    other = {**rows, "neighbour": {**rows["neighbour"], "max_num_seqs": 4}}  # another search's neighbour
    assert write_report(tmp_path, out, other)["verdict"].tolist()[1] == "not measured"
    other = {**rows, "pick": {**rows["pick"], "key": "another-workload"}}  # the same deployment, another search
    assert write_report(tmp_path, out, other)["verdict"].tolist()[0] == "not measured"


def run_cli(args: list[str], monkeypatch) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["search_check", *args])
    search_check.main()


def cli_error(args: list[str], monkeypatch, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        run_cli(args, monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and err.startswith("error: "), err
    return err


@pytest.fixture(scope="module")
def tiny_search(tmp_path_factory):
    """A two-deployment search's output folder, run once for the tests below."""
    tmp = tmp_path_factory.mktemp("search")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("HYDRA_FULL_ERROR", raising=False)
        mp.setattr(sys, "argv", ["search", *TINY, f"search.cache_dir={tmp / 'cache'}", f"hydra.run.dir={tmp / 'out'}"])
        search_module.main()
    return tmp / "out"


def test_a_search_checked_against_the_simulator(tiny_search, tmp_path, monkeypatch, capsys):
    """The simulator run again at the search's own workload and SLOs: each capacity within 10%,
    the pick's order kept."""
    run_cli([str(tiny_search), "--backend", "sim", "--out", str(tmp_path / "check")], monkeypatch)
    frame = pd.read_csv(tmp_path / "check" / "check.csv")
    assert list(frame["role"]) == ["pick", "neighbour"]
    assert list(frame["max_num_seqs"]) == [8, 2]
    assert frame["within"].all(), frame.to_string()
    assert (frame["rank_order"] == "kept").all()
    assert "rank order of the pick before the neighbour: kept" in capsys.readouterr().out


def test_bad_input_is_one_line_naming_the_field(tiny_search, tmp_path, monkeypatch, capsys):
    assert "result='nowhere' is not a folder" in cli_error(["nowhere"], monkeypatch, capsys)
    (tmp_path / "empty").mkdir()
    assert "has no table.csv" in cli_error([str(tmp_path / "empty")], monkeypatch, capsys)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("table.csv", "summary.json"):
        (bare / name).write_text((tiny_search / name).read_text())
    assert "has neither config.yaml nor .hydra/config.yaml" in cli_error([str(bare)], monkeypatch, capsys)
    (bare / "config.yaml").write_text((tiny_search / "config.yaml").read_text())
    summary = json.loads((bare / "summary.json").read_text())
    (bare / "summary.json").write_text(json.dumps({**summary, "target_rate": 1e6, "cheapest": None}))
    assert "has no pick: summary.json cheapest=null" in cli_error([str(bare)], monkeypatch, capsys)
    assert "--backend='server' is unknown" in cli_error([str(tiny_search), "--backend", "server"], monkeypatch, capsys)
    assert "--measure='all' is unknown" in cli_error([str(tiny_search), "--measure", "all"], monkeypatch, capsys)
    assert "--within=1.5 is invalid" in cli_error([str(tiny_search), "--backend", "sim", "--within", "1.5", "--out",
                                                   str(tmp_path / "c")], monkeypatch, capsys)


def test_the_fleet_what_if_searches_each_gpu_type_on_the_data_it_has(tmp_path):
    """Roofline for every GPU type; the operator model only where an operator profile exists (the
    H100's and H200's), each row saying which data it rests on and what priced its collectives."""
    from experiments import what_if_fleet
    out = tmp_path / "fleet"
    table = what_if_fleet._main([
        "--out", str(out), "model=qwen3-0.6b", "workload=poisson", "workload.prompt_len={dist: uniform, low: 16, high: 64}",
        "workload.output_len={dist: uniform, low: 4, high: 16}", "search.duration_s=2", "search.rate.max_iterations=2",
        "search.space.tensor_parallel_size=[1]", "search.space.replicas=[1,2]", "search.space.max_num_seqs=[8]",
        "search.target_rate=5", f"search.cache_dir={tmp_path / 'cache'}"])
    assert sorted(set(zip(table["latency"], table["gpu"]))) == [("operators", "h100"), ("operators", "h200"),
                                                                 ("roofline", "h100"), ("roofline", "h200")]
    md = (out / "what_if.md").read_text()
    assert "h200-bfloat16-tma.csv" in md and "h100-bfloat16-tma.csv" in md and "conf/hardware/h100.yaml" in md
    assert ": 1 GPU, $" in md and "1 GPUs" not in md  # the cheapest: one replica of one GPU
    assert len(pd.read_csv(out / "fleet.csv")) == len(table) == 8


def test_a_prediction_without_a_failing_rate_is_called_a_lower_bound(tmp_path):
    out = output(ROWS)
    pick = choose_pick(out, "engine")
    rows = {"pick": pick.to_dict() | {"failed_rps": math.nan},
            "neighbour": choose_neighbour(out, pick, "engine").to_dict() | {"failed_rps": 9.0}}
    write_report(tmp_path, out, rows)
    assert "no failing rate for the pick (" in (tmp_path / "check.md").read_text()
