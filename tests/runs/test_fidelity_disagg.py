"""conf/fidelity/disagg.yaml (prefill/decode split against mixed replicas, engine against simulator):
the specs parse and give each load's split and mixed scenario one request stream; the report's KV
transfer rows and its goodput-per-GPU comparison are computed from saved runs; and the whole spec
runs on the CPU (gloo engine pair, CPU engine fleet) with a tiny model."""
from __future__ import annotations

import json
import math
import shutil

import pandas as pd
import pytest

from experiments.lib import factory
from experiments.lib.fidelity_goodput import GoodputSpec, goodput_markdown, goodput_rows
from experiments.lib.fidelity_spec import compose_cfg, load_spec
from experiments.lib.metrics import goodput
from experiments.lib.run_workload import run

# The spec's scenarios and goodput section at a size the CPU runs in seconds.
TINY = """extends: {spec}
profile: null
common: [model=tiny-qwen3, hardware=h200, seed=0, progress=false, plots=false, scheduler.async_scheduling=true,
         cluster.replicas=2, workload=poisson, workload.num_requests=8, workload.prompt_len.low=8,
         workload.prompt_len.high=40, workload.output_len.low=3, workload.output_len.high=8,
         scheduler.max_model_len=128, scheduler.max_num_seqs=8, scheduler.enable_chunked_prefill=false,
         scheduler.max_num_batched_tokens=128, blocks.num_gpu_blocks=64, blocks.num_cpu_blocks=64]
engine: [backend=engine, backend.device=cpu]
sim: [backend=sim, latency=operators, latency.gpu=cpu, latency.dtype=float32]
"""


@pytest.fixture
def tiny_spec(request, tmp_path):
    path = tmp_path / "tiny-disagg.yaml"
    path.write_text(TINY.format(spec=request.config.rootpath / "conf/fidelity/disagg.yaml"))
    return path


@pytest.mark.parametrize("name", ["disagg.yaml", "disagg-llama.yaml"])
def test_the_disagg_specs_pair_a_split_and_a_mixed_run_on_one_stream(request, name):
    spec = load_spec(request.config.rootpath / "conf/fidelity" / name)
    gp = GoodputSpec.parse(spec["goodput"], spec["scenarios"], name)
    claims = {"tight": True, "loose": False} if name == "disagg.yaml" else {}  # the Llama spec claims nothing
    assert {s.name: s.split_wins for s in gp.slos if s.split_wins is not None} == claims
    assert len(gp.comparisons) == 2
    for comp in gp.comparisons:
        split, mixed = (compose_cfg([*spec["common"], *spec["scenarios"][s]["overrides"], *spec["sim"]])
                        for s in (comp.split, comp.mixed))
        assert list(split.cluster.roles) == ["prefill", "decode"] and mixed.cluster.roles is None
        assert split.cluster.replicas == mixed.cluster.replicas == 2
        assert not split.scheduler.enable_chunked_prefill  # the sweep's regime: prefill-first
        a, b = factory.workload(split), factory.workload(mixed)
        assert [(r.arrival_time, r.prompt_token_ids) for r in a.requests] == \
               [(r.arrival_time, r.prompt_token_ids) for r in b.requests]
    assert spec["capacity"] is None and spec["warmup"] == []
    names = list(spec["scenarios"])  # the pair's runs before the kept mixed replicas' (engine start-ups)
    assert names.index(gp.comparisons[-1].split) < names.index(gp.comparisons[0].mixed)


def test_a_goodput_section_naming_a_missing_scenario_is_refused(tmp_path, request):
    path = tmp_path / "bad.yaml"
    path.write_text(f"extends: {request.config.rootpath / 'conf/fidelity/disagg.yaml'}\n"
                    "goodput: {slos: {t: {tpot_s: 0.01}}, comparisons: {x: {split: pd_400, mixed: mixed_999}}}\n")
    with pytest.raises(ValueError, match=r"goodput.comparisons.x.mixed='mixed_999' is invalid"):
        load_spec(path)
    path.write_text(f"extends: {request.config.rootpath / 'conf/fidelity/disagg.yaml'}\n"
                    "goodput: {slos: {t: {tpot_ms: 10}}, comparisons: {}}\n")
    with pytest.raises(ValueError, match="key goodput.slos.t.tpot_ms is unknown"):
        load_spec(path)


def _requests(tpots: list[float], ttft: float = 0.1) -> pd.DataFrame:
    return pd.DataFrame({"status": ["finished"] * len(tpots), "ttft": [ttft] * len(tpots), "tpot": tpots,
                         "e2e": [1.0] * len(tpots)})


def test_goodput_per_gpu_and_the_claim_from_known_runs():
    """Split: 8 requests at 4 ms TPOT; mixed: 8 at 30 ms, over 2 s on 2 GPUs each. Tight (10 ms): 2 vs 0
    req/s/GPU, the split wins; loose (50 ms): 2 vs 2, a tie, which is not a win."""
    spec = GoodputSpec.parse({"margin": 0.05, "slos": {"tight": {"ttft_s": 1.0, "tpot_s": 0.01, "split_wins": True},
                                                       "loose": {"ttft_s": 1.0, "tpot_s": 0.05, "split_wins": False},
                                                       "ttft": {"ttft_s": 0.05}},
                              "comparisons": {"c": {"split": "p", "mixed": "m"}}}, {"p": {}, "m": {}}, "test")
    summary = {"duration_s": 2.0, "num_gpus": 2}
    split, mixed = (summary, _requests([0.004] * 8)), (summary, _requests([0.03] * 8))
    rows = goodput_rows(spec, {"p": {"engine": split, "sim": split}, "m": {"engine": mixed, "sim": mixed}})
    by = {(r["slo"], r["backend"]): r for r in rows}
    assert len(rows) == 6
    tight, loose, ttft = by["tight", "engine"], by["loose", "sim"], by["ttft", "engine"]
    assert (tight["split_per_gpu"], tight["mixed_per_gpu"]) == (2.0, 0.0)
    assert tight["ratio"] == math.inf and tight["split_beats"] and tight["claim_holds"]
    assert (loose["split_per_gpu"], loose["mixed_per_gpu"], loose["ratio"]) == (2.0, 2.0, 1.0)
    assert loose["split_beats"] is False and loose["claim_holds"] is True
    assert math.isnan(ttft["ratio"]) and ttft["split_beats"] is None and ttft["claim_holds"] is None  # none met it
    md = goodput_markdown(spec, rows)
    assert "| c | tight (1000 ms, 10 ms) | 2.0 / 2.0 | 0.0 / 0.0 | inf / inf | yes / yes | split wins: engine yes" in md
    assert goodput(_requests([0.004] * 8), 2.0, {"tpot_s": 0.01}, 2) == 2.0  # the metric it shares


def test_transfer_and_goodput_rows_are_computed_from_saved_runs(tiny_spec, tmp_path):
    """Saved runs as the engine's (simulator traces, standing in for the GPU's): the simulator half
    and the report from them; the same config on both sides gives zero errors and equal goodput."""
    from experiments.fidelity import _main
    spec = load_spec(tiny_spec)
    saved = tmp_path / "saved"
    for name, scn in spec["scenarios"].items():
        run(compose_cfg([*spec["common"], *scn["overrides"], *spec["sim"]]), saved / name / "engine", name)
    out = tmp_path / "report"
    fid = _main(["--spec", str(tiny_spec), "--engine-runs", str(saved), "--runs", str(tmp_path / "runs"),
                 "--out", str(out)])
    transfer = pd.read_csv(out / "transfer.csv")
    assert sorted(transfer["scenario"].unique()) == ["pd_400", "pd_500"]  # only the split's runs hand off
    assert set(transfer["metric"]) == {"transfer_mean", "transfer_p90", "decode_wait_mean", "link_wait_mean",
                                       "link_time_mean", "prefill_time_mean"}
    assert (transfer["rel_error"] == 0).all() and (transfer["engine"] > 0).all()
    saved_pd = pd.read_parquet(saved / "pd_500" / "engine" / "requests.parquet")
    row = transfer[(transfer["scenario"] == "pd_500") & (transfer["metric"] == "transfer_mean")].iloc[0]
    assert row["engine"] == pytest.approx(saved_pd["transfer_time"].mean())
    rows = pd.read_csv(out / "goodput.csv")
    assert len(rows) == 2 * 4 * 2  # comparisons x SLOs x backends
    for _, g in rows.groupby(["comparison", "slo"]):
        e, s = g[g["backend"] == "engine"].iloc[0], g[g["backend"] == "sim"].iloc[0]
        assert e["split_per_gpu"] == s["split_per_gpu"] and e["mixed_per_gpu"] == s["mixed_per_gpu"]
    tight = rows[(rows["comparison"] == "load_500") & (rows["slo"] == "tight") & (rows["backend"] == "engine")].iloc[0]
    summary = json.loads((saved / "pd_500" / "engine" / "summary.json").read_text())
    assert tight["split_per_gpu"] == pytest.approx(
        goodput(saved_pd, summary["duration_s"], {"ttft_s": 1.0, "tpot_s": 0.01}, summary["num_gpus"]))
    text = (out / "fidelity.md").read_text()
    assert "## KV transfer (disaggregated scenarios)" in text and "## Goodput per GPU: split against mixed" in text
    assert "Targets: <= 10% on mean transfer, <= 10% on p90 transfer" in text
    assert fid.results["pd_400"]["sim"][0]["disaggregation"]["handed_off"] > 0


@pytest.mark.slow
def test_the_disagg_spec_runs_on_the_cpu(tiny_spec, tmp_path):
    """Every scenario through the CPU engine (the pair over gloo, the fleet's two replica processes),
    then the simulator half from the saved runs: the GPU command and the CPU command, small."""
    from experiments.fidelity import _main
    from experiments.lib import engine_fleet
    runs = tmp_path / "runs"
    try:
        _main(["--spec", str(tiny_spec), "--engine-only", "--runs", str(runs)])
    finally:
        engine_fleet.release_fleet()
    for name in ("pd_400", "pd_500", "mixed_400", "mixed_500"):
        summary = json.loads((runs / name / "engine" / "summary.json").read_text())
        assert summary["completed"] == 8 and summary["run"]["backend"] == "engine"
        assert ("disaggregation" in summary) == name.startswith("pd_")
    shutil.rmtree(runs / "mixed_400")  # a scenario the GPU did not get to: left out of the report
    fid = _main(["--spec", str(tiny_spec), "--engine-runs", str(runs), "--scenarios", "pd_400,pd_500,mixed_500",
                 "--runs", str(tmp_path / "sim"), "--out", str(tmp_path / "report")])
    assert sorted(pd.read_csv(tmp_path / "report" / "transfer.csv")["scenario"].unique()) == ["pd_400", "pd_500"]
    assert set(pd.read_csv(tmp_path / "report" / "goodput.csv")["comparison"]) == {"load_500"}
    assert fid.results["pd_500"]["engine"][0]["disaggregation"]["handed_off"] > 0
