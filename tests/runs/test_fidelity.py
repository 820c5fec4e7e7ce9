"""The fidelity report on traces with a known error, the policy-ranking verdicts, and a tiny CPU
end-to-end fidelity run (profiler on a tiny grid, then engine vs simulator)."""
from __future__ import annotations

import json
import math
import shutil

import pandas as pd
import pytest
import yaml

from experiments.lib.bootstrap import combine_rounds
from experiments.lib.fidelity_report import (
    breakdown_markdown,
    decode_step_ratio,
    error_markdown,
    error_rows,
    error_table,
    metric_values,
    ranking_markdown,
    ranking_row,
    relative_error,
    step_breakdown_rows,
    target_summary,
)
from experiments.lib.fidelity_tables import FidelityTables
from experiments.lib.metrics import summarize
from experiments.lib.traces import requests_frame, steps_frame
from policies import (
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    TraceRecorder,
    make_block_manager,
    make_policy,
)
from sim import Simulator
from sim.latency import LatencyModel
from sim.latency.profiled import ProfiledModel


class Linear(LatencyModel):
    """Step time = scale * (1 ms + 10 us per scheduled token): a stand-in for a measured backend."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def step_time(self, out) -> float:
        return self.scale * (1e-3 + 1e-5 * sum(s.num_new_tokens for s in out.scheduled))

    def swap_time(self, num_blocks: int) -> float:
        return self.scale * 1e-5 * num_blocks


def traces(scale: float, num_gpu_blocks: int = 400):
    requests = [Request(str(i), [i % 50 + 1] * (20 + 7 * i), SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True))
                for i in range(24)]
    recorder = TraceRecorder()
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8, max_model_len=512),
                      make_policy("fcfs", preemption_mode="recompute"),
                      make_block_manager("paged", 16, num_gpu_blocks, 0, 0.01, 512), recorder)
    Simulator(sched, Linear(scale), requests).run()
    req, steps = requests_frame(recorder), steps_frame(recorder)
    return summarize(req, steps, 16), req, steps


def test_error_table_on_traces_with_a_known_error():
    engine, _, _ = traces(1.0)
    sim, _, _ = traces(1.1)  # every step 10% slower, all arrivals at t = 0: same schedule, times x 1.1
    rows = {r["metric"]: r for r in error_rows(engine, sim, "known")}
    assert rows["request_throughput"]["rel_error"] == pytest.approx(1 / 1.1 - 1, rel=1e-9)
    assert rows["output_throughput"]["rel_error"] == pytest.approx(1 / 1.1 - 1, rel=1e-9)
    for m in ("ttft_mean", "ttft_p90", "tpot_mean", "e2e_mean"):
        assert rows[m]["rel_error"] == pytest.approx(0.1, rel=1e-9), m
    assert rows["num_preemptions"]["rel_error"] == 0.0
    assert rows["request_throughput"]["within_target"] is False  # 9.1% > 5%
    assert rows["ttft_p90"]["within_target"] is True  # 10% <= 10%
    assert rows["e2e_mean"]["within_target"] is None  # no target
    table = error_table(list(rows.values()))
    md = error_markdown(table)
    assert "| known |" in md and "+10.0%" in md and "**!**" in md
    assert target_summary(table).startswith("1/4 targeted errors within target")


def test_repeated_engine_runs_give_the_mean_and_its_noise():
    """Two engine runs with steps 1.0x and 1.2x as long: the engine value is their mean, the spread
    their range over the mean (TPOT 1.0 and 1.2 -> 0.2 / 1.1), and an error inside that range counts
    as within the engine's own noise."""
    fast, slow, sim = traces(1.0)[0], traces(1.2)[0], traces(1.1)[0]
    rows = {r["metric"]: r for r in error_rows(fast, sim, "noisy", [fast, slow])}
    tpot = rows["tpot_mean"]
    assert tpot["engine"] == pytest.approx((fast["tpot"]["mean"] + slow["tpot"]["mean"]) / 2, rel=1e-12)
    assert tpot["engine_spread"] == pytest.approx(0.2 / 1.1, rel=1e-9)
    assert abs(tpot["rel_error"]) < 1e-9  # 1.1x is the mean of 1.0x and 1.2x
    assert rows["num_preemptions"]["engine_spread"] == 0.0
    single = {r["metric"]: r for r in error_rows(fast, sim, "one", [fast])}
    assert math.isnan(single["tpot_mean"]["engine_spread"]) and single["tpot_mean"]["rel_error"] == pytest.approx(0.1)
    off = {r["metric"]: r for r in error_rows(fast, traces(1.17)[0], "off", [fast, slow])}  # TPOT +6.4%
    table = error_table(list(off.values()))
    assert not off["tpot_mean"]["within_target"] and abs(off["tpot_mean"]["rel_error"]) < off["tpot_mean"]["engine_spread"]
    assert "±9.1%" in error_markdown(table)  # half of the 18.2% range
    summary = target_summary(table)
    assert summary.startswith("1/4 targeted errors within target")  # only p90 TTFT (+6.4% <= 10%)
    assert "4/4 within target or within the engine's own run-to-run range" in summary


def test_step_breakdown_attributes_the_error_to_step_kinds():
    _, _, fast = traces(1.0)
    _, _, slow = traces(1.1)
    rows = step_breakdown_rows(fast, slow, "known")  # the 1.0 run on the wall-clock side
    assert {r["kind"] for r in rows} == {"decode", "mixed"}
    for r in rows:
        assert r["engine_steps"] == r["sim_steps"] > 0
        assert r["rel_error"] == pytest.approx(0.1, rel=1e-6)
    assert "| known | decode |" in breakdown_markdown(rows)


def test_step_breakdown_of_a_fleet_times_each_replica_on_its_own_steps():
    """A fleet's steps trace interleaves its replicas' steps in time order; a wall-clock step
    lasts until the same replica's next step, not the next row (another replica's step)."""
    _, _, steps = traces(1.0)
    fleet = pd.concat([steps.assign(replica=0), steps.assign(replica=1, time=steps["time"] + 3e-4)])
    fleet = fleet.sort_values(["time", "replica"], kind="stable").reset_index(drop=True)
    assert (fleet["replica"].diff().fillna(1) != 0).mean() > 0.5  # the replicas' rows interleave
    rows = step_breakdown_rows(fleet, fleet, "fleet")
    for r in rows:
        assert r["engine_steps"] == r["sim_steps"] > 0
        assert r["engine_mean_s"] == pytest.approx(r["sim_mean_s"], rel=1e-9)
        assert r["engine_total_s"] == pytest.approx(r["sim_total_s"], rel=1e-9)


def test_step_breakdown_of_a_pair_compares_the_replicas_the_engine_trace_holds():
    """An engine pair's trace holds its decode engine's steps (replica 1) beside its prefill
    engine's: the simulated decode replica's steps are compared with them; a trace of the prefill
    engine alone is compared with the simulated prefill replica alone."""
    _, _, steps = traces(1.0)
    prefill = steps[steps["num_prefill_tokens"] > 0].assign(replica=0)
    decode = steps[steps["num_prefill_tokens"] == 0].assign(replica=1)
    pair = pd.concat([prefill, decode]).sort_values("time", kind="stable").reset_index(drop=True)
    summary = {"disaggregation": {"transfers": 1}}
    both = FidelityTables._comparable_steps({"engine": (summary, None, pair), "sim": (summary, None, pair)})
    rows = {r["kind"]: r for r in step_breakdown_rows(pair, both, "pair")}
    assert rows["decode"]["sim_steps"] == rows["decode"]["engine_steps"] == len(decode)
    assert rows["mixed"]["sim_steps"] == rows["mixed"]["engine_steps"] == len(prefill)
    alone = FidelityTables._comparable_steps({"engine": (summary, None, pair[pair["replica"] == 0]),
                                              "sim": (summary, None, pair)})
    assert set(alone["replica"]) == {0}


def test_identical_traces_have_zero_error_and_preemptions_are_counted():
    engine, req, _ = traces(1.0, num_gpu_blocks=40)  # few blocks: the scheduler must preempt
    assert engine["num_preemptions"] > 0
    rows = error_rows(engine, traces(1.0, num_gpu_blocks=40)[0], "same")
    assert all(r["rel_error"] == 0.0 for r in rows)
    assert metric_values(engine)["num_preemptions"] == req["num_preemptions"].sum()


def test_relative_error_edge_cases():
    assert relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert relative_error(0.0, 0.0) == 0.0
    assert math.isnan(relative_error(3.0, 0.0))
    assert math.isnan(relative_error(math.nan, 1.0))


def test_ranking_verdicts():
    ab = lambda a, b, lo, hi: {"a": a, "b": b, "diff": b - a, "ci_low": lo, "ci_high": hi}
    good = ranking_row("x", "ttft mean (all)", ab(1.0, 0.5, -0.6, -0.4), ab(1.1, 0.6, -0.6, -0.4))
    assert good["sign_predicted"] and good["size_predicted"] and good["engine_significant"]
    assert good["size_ratio"] == pytest.approx(1.0)
    off = ranking_row("x", "ttft mean (all)", ab(1.0, 0.5, -0.6, -0.4), ab(1.0, 0.9, -0.2, 0.0))
    assert off["sign_predicted"] and not off["size_predicted"]
    wrong = ranking_row("x", "e2e mean (all)", ab(1.0, 1.2, -0.1, 0.3), ab(1.0, 0.9, -0.2, 0.0))
    assert not wrong["sign_predicted"] and not wrong["engine_significant"]
    run_level = ranking_row("x", "request_throughput run (all)",
                            {"a": 10.0, "b": 11.0, "diff": 1.0, "ci_low": math.nan, "ci_high": math.nan,
                             "significant": None}, ab(10.0, 10.5, math.nan, math.nan))
    assert run_level["engine_significant"]  # one run each: no interval, as without the verdict key
    md = ranking_markdown([good, off, wrong])
    assert md.count("| x |") == 3 and "NO" in md and "(n.s.)" in md


def test_decode_step_ratio_compares_a_run_with_the_profile():
    """Decode-only steps 1.1x the price (prefill and swap steps ignored): ratio 1.1; none: nan."""
    price = lambda d, c: 1e-3 + 1e-6 * d + 1e-9 * c
    rows = [(0, d, 100 * d, 0, 0, 1.1 * price(d, 100 * d)) for d in (1, 4, 16)]
    rows += [(64, 2, 200, 0, 0, 9.0), (0, 3, 300, 4, 0, 9.0)]  # a mixed step, a swap step
    cols = ["num_prefill_tokens", "num_decode_seqs", "kv_tokens", "num_swap_out_blocks", "num_swap_in_blocks", "duration"]
    steps = pd.DataFrame(rows, columns=cols)
    assert decode_step_ratio(steps, price) == pytest.approx(1.1)
    assert math.isnan(decode_step_ratio(steps.iloc[3:], price))


def test_repeated_rounds_decide_whether_an_engine_difference_is_significant():
    """Per-round A/B differences: means are reported; a difference is significant only when every
    round's interval excludes 0, the rounds agree in sign (host drift can flip a small one) and it
    exceeds the arms' own run-to-run noise."""
    ab = lambda a, b, lo, hi: {"a": a, "b": b, "diff": b - a, "ci_low": lo, "ci_high": hi}
    flip = combine_rounds([ab(1.0, 1.03, 0.01, 0.05), ab(1.1, 1.08, -0.04, -0.01)])
    assert flip["a"] == pytest.approx(1.05) and flip["b"] == pytest.approx(1.055) and flip["diff"] == pytest.approx(0.005)
    assert flip["significant"] is False and flip["rounds"] == 2
    steady = combine_rounds([ab(1.0, 0.5, -0.6, -0.4), ab(1.2, 0.6, -0.7, -0.5)])
    assert steady["significant"] is True and steady["ci_low"] == -0.7 and steady["ci_high"] == -0.4
    wide = combine_rounds([ab(1.0, 0.9, -0.2, 0.05), ab(1.0, 0.8, -0.3, -0.1)])
    assert wide["significant"] is False  # one round's interval includes 0
    noisy = combine_rounds([ab(1.0, 0.97, -0.04, -0.02), ab(1.1, 1.07, -0.04, -0.02)])
    assert noisy["significant"] is False  # -0.03 each round, but A itself moved 0.1 between rounds
    assert combine_rounds([ab(1.0, 0.5, -0.6, -0.4)]) == ab(1.0, 0.5, -0.6, -0.4)
    sim = ab(1.0, 1.01, math.nan, math.nan)
    rows = [ranking_row("x", "e2e mean (all)", flip, sim), ranking_row("x", "ttft mean (all)", steady, ab(1.0, 0.55, 0, 0))]
    assert not rows[0]["engine_significant"] and rows[1]["engine_significant"]
    md = ranking_markdown(rows)
    assert "(n.s.)" in md and "Sign predicted for 2/2 differences and size for 1/2" in md
    assert "of the 1 the engine shows significantly: sign 1/1, size 1/1" in md


@pytest.mark.slow
def test_tiny_cpu_fidelity_run_end_to_end(tmp_path, request, monkeypatch):
    """Profiler on a tiny grid (CPU), then every scenario of conf/fidelity/tiny.yaml through the
    CPU engine and the simulator reading that profile; checks the outputs, not the (CPU-noise) errors."""
    from hydra import compose, initialize_config_module

    from experiments.fidelity import _main
    from experiments.profile import profile
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="profile", overrides=[
            "model=tiny-qwen3", "device=cpu", "warmup=0", "repeats=1", "host_repeats=1", "passes=1", "max_model_len=128",
            "max_num_seqs=8", "progress=false", "calibrate=false", f"out={tmp_path / 'cpu-tiny-qwen3.csv'}",
            "profile_grid.prefill_tokens=[0,8,64]", "profile_grid.decode_seqs=[0,2,7]",
            "profile_grid.context_per_decode=[4,64]", "profile_grid.swap_blocks=[1,4]",
            "profile_grid.split_prefill_tokens=[8]", "profile_grid.split_counts=[1,2]",
            "profile_grid.context_ratios=[1,1.5]"])  # the batch-shape axis, priced by the simulator
    csv, _ = profile(cfg, "pytest")
    spec = request.config.rootpath / "conf/fidelity/tiny.yaml"
    out, runs = tmp_path / "out", tmp_path / "runs"
    fid = _main(["--spec", str(spec), "--out", str(out), "--runs", str(runs), "--profile", str(csv)])
    scenarios = list(yaml.safe_load(spec.read_text())["scenarios"])
    table = fid.error_table()
    assert sorted(table["scenario"].unique()) == sorted(scenarios)
    assert len(table) == len(scenarios) * 7
    for name in scenarios:
        assert (out / f"{name}.png").stat().st_size > 0
        for backend in ("engine", "sim"):
            assert (runs / name / backend / "requests.parquet").is_file()
        engine, sim = fid.results[name]["engine"][0], fid.results[name]["sim"][0]
        assert engine["completed"] == sim["completed"] == 6
        assert engine["run"]["backend"] == "engine" and sim["run"]["latency_model"] == "profiled"
    # Both sides scheduled ahead (the spec's scheduler.async_scheduling), steps of the sync fallback too.
    for backend in ("engine", "sim"):
        steps = pd.read_parquet(runs / "poisson" / backend / "steps.parquet")
        assert len(steps) > 3 and (steps["time"].diff().dropna() > 0).all()
    assert fid.results["pressure_swap"]["engine"][0]["num_preempted_swap"] > 0
    assert fid.results["pressure_recompute"]["sim"][0]["num_preempted_recompute"] > 0
    assert fid.settings["poisson"]["rate"] > 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["device"] == "cpu" and "--spec" in meta["command"]
    assert "| offline |" in (out / "fidelity.md").read_text()
    assert "host CPU gauge before each engine run" in (out / "fidelity.md").read_text()
    assert all(r > 0 for r in fid.settings["offline"]["decode_vs_profile"])
    assert "decode steps / profile per engine run" in (out / "fidelity.md").read_text()
    assert len(fid.ranking()) == 2
    # The simulator side alone, reusing the engine traces (two stored repeats: identical copies, so
    # no spread): identical engine numbers.
    shutil.copytree(runs / "offline" / "engine", runs / "offline" / "engine_r2")
    again = _main(["--spec", str(spec), "--out", str(tmp_path / "out2"), "--runs", str(tmp_path / "runs2"),
                   "--profile", str(csv), "--engine-runs", str(runs), "--scenarios", "offline"])
    assert again.results["offline"]["engine"][0]["duration_s"] == fid.results["offline"]["engine"][0]["duration_s"]
    assert len(again.results["offline"]["engine_summaries"]) == 2
    assert (again.error_table()["engine_spread"] == 0.0).all()
    # The same engine runs against latency=operators (the committed CPU operator profile): no per-model profile.
    ops = _main(["--spec", str(spec), "--out", str(tmp_path / "out_ops"), "--runs", str(tmp_path / "runs_ops"),
                 "--engine-runs", str(runs), "--scenarios", "offline", "--sim", "latency=operators",
                 "--sim", "latency.gpu=cpu", "--sim", "latency.dtype=float32"])
    assert ops.results["offline"]["sim"][0]["run"]["latency_model"] == "operators"
    assert "decode_vs_profile" not in ops.settings["offline"]
    assert json.loads((tmp_path / "out_ops" / "meta.json").read_text())["profile"] == "latency=operators"
    assert (tmp_path / "out_ops" / "fidelity.md").read_text().startswith("# Simulator fidelity: engine vs sim (operators latency)")
    assert (out / "fidelity.md").read_text().startswith("# Simulator fidelity: engine vs sim (profiled latency)")
    # The GPU stage alone: engine traces and meta.json, no simulator run, no report; the repeats run
    # in rounds over the scenarios (capacity scenario first in each), each after a host CPU gauge.
    import experiments.fidelity as fidelity_module
    labels, real_run = [], fidelity_module.run
    monkeypatch.setattr(fidelity_module, "run", lambda cfg, out, label, *a: labels.append(label) or real_run(cfg, out, label, *a))
    engine_only = tmp_path / "engine_only"
    _main(["--spec", str(spec), "--runs", str(engine_only), "--engine-only", "--scenarios", "poisson,offline",
           "--engine-repeats", "2", "--window-profile", "--profile", str(csv)])
    assert labels == ["offline engine", "poisson engine", "offline engine (round 2)", "poisson engine (round 2)"]
    # --window-profile: the profile's decode-only rows (2 and 7 sequences x 2 contexts x 2 ratios) re-timed
    # on the capacity scenario's engine each round; the simulator side reads them in place of the standalone rows.
    periods = pd.read_csv(engine_only / "window_periods.csv")
    assert sorted(periods["round"].unique()) == [0, 1] and len(periods) == 2 * 8 and (periods["time_s"] > 0).all()
    sim_side = _main(["--spec", str(spec), "--out", str(tmp_path / "out3"), "--runs", str(tmp_path / "runs3"),
                      "--profile", str(csv), "--engine-runs", str(engine_only), "--scenarios", "offline"])
    window = engine_only / "window-profile.csv"
    assert sim_side.sim_profile() == str(window) and "window_profile: 8 decode-only rows" in window.read_text()
    standalone, windowed = ProfiledModel(csv, 16), ProfiledModel(window, 16)
    median = periods[(periods.num_decode_seqs == 7) & (periods.context_per_decode == 64)
                     & (periods.context_ratio == 1.5)]["time_s"].median()
    assert windowed.lookup(0, 7, 7 * 64, max_context_tokens=96) == pytest.approx(median)
    assert windowed.lookup(64, 0, 0) == standalone.lookup(64, 0, 0)
    assert "window-profile.csv" in (tmp_path / "out3" / "fidelity.md").read_text()
    for name in ("offline", "poisson"):
        assert (engine_only / name / "engine" / "requests.parquet").is_file()
        assert (engine_only / name / "engine_r2" / "requests.parquet").is_file()
        assert not (engine_only / name / "sim").exists()
    settings = json.loads((engine_only / "meta.json").read_text())["scenarios"]
    assert settings["offline"]["num_requests"] == 6 and settings["poisson"]["rate"] > 0
    assert len(settings["poisson"]["host_probe_us"]) == 2 and min(settings["poisson"]["host_probe_us"]) > 0


def test_window_profile_needs_an_engine(tmp_path):
    from experiments.lib import fidelity_window
    with pytest.raises(ValueError, match="--window-profile is invalid here"):
        fidelity_window.measure(None, tmp_path / "unused.csv", 0, tmp_path)
    assert fidelity_window.window_profile(tmp_path / "unused.csv", tmp_path) is None  # no window timings


def test_a_spec_extends_another_and_names_its_profile_and_kernel(request, tmp_path):
    """conf/fidelity/packed.yaml is the default spec with the run of record's kernel and profile."""
    from experiments.lib.fidelity_spec import load_spec

    root = request.config.rootpath / "conf/fidelity"
    default, packed = load_spec(root / "default.yaml"), load_spec(root / "packed.yaml")
    assert "backend.decode_kernel=auto" in default["engine"]
    assert (request.config.rootpath / default["profile"]).is_file()  # the default engine's own profile
    assert packed["engine"] == ["backend=engine", "backend.decode_kernel=packed"]
    assert packed["scenarios"] == default["scenarios"] and packed["common"] == default["common"]
    assert (request.config.rootpath / packed["profile"]).is_file()
    (tmp_path / "bad.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(ValueError, match="extends='missing.yaml' is invalid"):
        load_spec(tmp_path / "bad.yaml")


def test_engine_runs_of_another_decode_kernel_than_the_profile_are_refused():
    from experiments.fidelity import check_decode_kernel

    check_decode_kernel("p.csv", {"decode_kernel": "tma"}, "offline", [{"decode_kernel": "tma"}])
    check_decode_kernel("p.csv", {}, "offline", [{"decode_kernel": "tma"}])  # an older profile: not named
    check_decode_kernel("p.csv", {"decode_kernel": "tma"}, "offline", [{}])  # older traces: not named
    with pytest.raises(ValueError, match="taken with decode_kernel=packed, but the engine runs of scenario "
                                         r"offline ran \['tma'\]"):
        check_decode_kernel("p.csv", {"decode_kernel": "packed"}, "offline", [{"decode_kernel": "tma"}])


def test_the_mlfq_spec_runs_one_stream_under_fcfs_and_mlfq(request):
    """conf/fidelity/mlfq.yaml: the engine A/B of fcfs -> mlfq as two scenarios differing in the policy alone."""
    from experiments.lib import factory
    from experiments.lib.fidelity_spec import compose_cfg, load_spec

    spec = load_spec(request.config.rootpath / "conf/fidelity/mlfq.yaml")
    fcfs, mlfq = (spec["scenarios"][name]["overrides"] for name in ("heavy_tail_fcfs", "heavy_tail_mlfq"))
    assert [o for o in fcfs if o != "policy=fcfs"] == [o for o in mlfq if o != "policy=mlfq"]
    assert [(ab["a"], ab["b"]) for ab in spec["ab"]] == [("heavy_tail_fcfs", "heavy_tail_mlfq")]
    cfg = compose_cfg([*spec["common"], *mlfq, *spec["sim"]])
    assert (cfg.policy.name, cfg.blocks.kv_cache_gib, len(factory.workload(cfg))) == ("mlfq", 4, 600)


def test_runs_started_in_the_same_second_get_their_own_trace_dirs(tmp_path):
    from experiments.lib.run_dirs import fresh_dir

    stamp = tmp_path / "2026-11-28" / "14-03-35"
    dirs = [fresh_dir(stamp) for _ in range(3)]
    assert [d.name for d in dirs] == ["14-03-35", "14-03-35-2", "14-03-35-3"] and all(d.is_dir() for d in dirs)


def test_an_override_the_spec_sets_later_is_refused_not_lost(tmp_path):
    from experiments.fidelity import _main

    with pytest.raises(ValueError, match=r"override 'cluster.kv_receive_profile=x.csv': conf/fidelity/disagg.yaml "
                                         r"sets cluster.kv_receive_profile in its sim list, .* pass it with --sim"):
        _main(["--spec", "conf/fidelity/disagg.yaml", "--runs", str(tmp_path), "cluster.kv_receive_profile=x.csv"])
    with pytest.raises(ValueError, match=r"sets workload.rate in scenario pd_400's overrides"):
        _main(["--spec", "conf/fidelity/disagg.yaml", "--runs", str(tmp_path), "workload.rate=100"])
