"""The profiler (CPU, tiny model and grid), its CSV schema and loading, the profiled model's
interpolation and its optional metadata, and the roofline calibration."""
from __future__ import annotations

import itertools
import random
import re

import pytest
import torch
import yaml
from hydra import compose, initialize_config_module

from engine.config import CacheConfig
from engine.device.model_runner import ModelRunner
from engine.model_loader import load_model_config
from experiments.lib.profiling.calibration import calibrate, calibrate_to_file, profile_points
from experiments.lib.profiling.grid import ProfileGrid, fit_prefill_pair_s, write_profile
from experiments.lib.profiling.host import decode_periods, host_overheads, prompt_lens
from experiments.lib.profiling.synthetic import StepShape, blocks_needed, synthetic_step
from experiments.profile import gpu_slug, profile
from sim.latency import BatchShape, Hardware, ModelShape, ProfiledModel, RooflineModel
from sim.latency.prefill_schedule import PrefillSchedule
from sim.latency.profile_io import COLUMNS, read_profile

TINY_GRID = ["profile_grid.prefill_tokens=[0,8]", "profile_grid.decode_seqs=[0,2]",
             "profile_grid.context_per_decode=[4,16]", "profile_grid.swap_blocks=[1,2]",
             "profile_grid.split_prefill_tokens=[8]", "profile_grid.split_counts=[1,2]",
             "profile_grid.context_ratios=[]"]


def assert_sum_of_parts(row) -> None:
    """time_s = forward_s + host_s up to the file's 7 significant digits of each (a slow forward on a
    busy CPU gives a host_s of nearly its size with the opposite sign)."""
    f, h = float(row["forward_s"]), float(row["host_s"])
    assert float(row["time_s"]) == pytest.approx(f + h, rel=1e-5, abs=1e-6 * max(abs(f), abs(h)))


def tiny_profile(path, extra=()):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="profile", overrides=[
            "model=tiny-qwen3", "device=cpu", "warmup=0", "repeats=1", "host_repeats=1", "passes=2", "max_model_len=64",
            "max_num_seqs=4", "progress=false", "calibrate=false", f"out={path}", *TINY_GRID, *extra])
    return profile(cfg, "pytest")


def test_profiler_on_cpu_writes_a_profile_the_simulator_loads(tmp_path):
    path, _ = tiny_profile(tmp_path / "cpu-tiny-qwen3.csv")
    file_meta, rows = read_profile(path)
    for key in ("model", "block_size", "device", "dtype", "versions", "date", "command", "prefill_pair_s",
                "prefill_schedule", "prefill_tile_s", "prefill_split_rows", "admission_s"):
        assert key in file_meta, key
    # tiny-qwen3's prefill kernel geometry on the CPU stand-in (4 "SMs", one program each)
    assert PrefillSchedule.parse(file_meta["prefill_schedule"]).concurrent == 4
    assert file_meta["model"] == "tiny-qwen3" and file_meta["device"] == "cpu"
    assert file_meta["decode_kernel"] == "packed"  # what the default "auto" resolves to on the CPU
    assert "torch" in file_meta["versions"] and "transformers" in file_meta["versions"]
    header = path.read_text().splitlines()[len(file_meta)]
    assert header.split(",")[:len(COLUMNS)] == list(COLUMNS)
    steps = [r for _, r in rows if r["kind"] == "step"]
    swaps = [r for _, r in rows if r["kind"] == "swap"]
    # P in {0, 8} x (D = 0, or D = 2 x C in {4, 16}): 6 rows (0/0 repeats P=8's); swaps both ways.
    assert len(steps) == 6 and len(swaps) == 4
    assert steps[0]["time_s"] == next(r["time_s"] for r in steps[1:] if r["num_decode_seqs"] == "0")
    for r in steps:
        assert_sum_of_parts(r)
        # host_s is a difference of two medians, noise-dominated on a busy CPU: only bounded here
        assert float(r["forward_s"]) > 0 and float(r["time_s"]) > 0 and abs(float(r["host_s"])) < 0.5
    model = ProfiledModel(path, block_size=16, model_name="tiny-qwen3")
    for r in steps:
        p, d, c = (int(r[k]) for k in ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens"))
        assert model.lookup(p, d, c) == pytest.approx(float(r["time_s"]), rel=1e-5)
    with pytest.raises(ValueError, match="model='tiny-qwen3'"):
        ProfiledModel(path, block_size=16, model_name="qwen3-0.6b")
    # the engine's add_request, timed: the simulator's arrivals pay it (tests/simulation/test_sim.py)
    assert model.admission_s == float(file_meta["admission_s"]) > 0


def test_admission_cost_must_be_a_number(tmp_path):
    path, _ = tiny_profile(tmp_path / "p.csv")
    text = path.read_text()
    bad = tmp_path / "bad.csv"
    bad.write_text(re.sub(r"# admission_s: .*", "# admission_s: -1", text))
    with pytest.raises(ValueError, match=r"admission_s='-1' is invalid"):
        ProfiledModel(bad, block_size=16)


def test_synthetic_steps_have_the_requested_shape_and_distinct_blocks():
    shape = StepShape(num_prefill_tokens=40, num_prefill_seqs=3, num_decode_seqs=5, context_per_decode=33)
    out = synthetic_step(shape, block_size=16, num_gpu_blocks=100, vocab_size=256)
    b = BatchShape.of(out)
    assert (b.num_prefill_tokens, b.num_prefill_seqs, b.num_decode_seqs) == (40, 3, 5)
    assert b.num_context_tokens == shape.num_context_tokens == 5 * 33
    assert b.prefill_attention_pairs == shape.prefill_attention_pairs
    blocks = [blk for s in out.scheduled for blk in s.seq.block_table]
    assert len(blocks) == len(set(blocks)) == blocks_needed(shape, 16)
    assert all(t < 256 for s in out.scheduled for t in s.seq.token_ids)
    with pytest.raises(ValueError, match="num_gpu_blocks=3"):
        synthetic_step(shape, block_size=16, num_gpu_blocks=3, vocab_size=256)


def test_grid_validation_names_the_field():
    good = {"prefill_tokens": [0, 64], "decode_seqs": [0, 8], "context_per_decode": [16], "swap_blocks": [1],
            "split_prefill_tokens": [64], "split_counts": [1, 2]}
    grid = ProfileGrid.from_dict(good)
    assert len(grid.step_shapes()) == 3 and len(grid.split_shapes()) == 2
    for key, bad in (("decode_seqs", [0, -1]), ("prefill_tokens", [0, 1]), ("swap_blocks", []),
                     ("context_per_decode", [16, 16]), ("split_counts", [1, 128]),
                     ("split_prefill_tokens", [128])):
        with pytest.raises(ValueError, match=key):
            ProfileGrid.from_dict({**good, key: bad})


def test_warm_reruns_time_the_same_step_again():
    """_TimedRunner re-runs an execute back to back and keeps the re-runs' median; the result
    returned is the first run's."""
    import time

    from experiments.lib.profiling.host import _TimedRunner

    class SlowRunner:
        num_gpu_blocks, num_cpu_blocks, vocab_size, device = 1, 0, 8, torch.device("cpu")

        def __init__(self):
            self.calls = 0

        def execute(self, out):
            self.calls += 1
            time.sleep(0.002)
            return self.calls

    runner = SlowRunner()
    timed = _TimedRunner(runner)
    assert timed.execute(None) == 1 and timed.warm_s == 0.0  # no re-runs by default
    timed.reruns = 3
    assert timed.execute(None) == 2 and runner.calls == 5
    assert 0.002 <= timed.warm_s < 0.1


def test_host_overhead_is_measured_for_decode_and_prefill_steps():
    """On a real engine around a (CPU) runner: bounded (a difference of medians, noisy on a busy CPU),
    and the runner is left idle."""
    runner = ModelRunner(load_model_config("tiny-qwen3"), CacheConfig(block_size=16, num_gpu_blocks=64,
                                                                    swap_space=0),
                         max_num_batched_tokens=96, max_num_seqs=9, max_model_len=128, device="cpu")
    host = host_overheads(runner, [(0, 8), (64, 8)], warmup=1, repeats=2)
    assert set(host) == {(0, 8), (64, 8)} and all(abs(h) < 0.5 for h in host.values())
    with pytest.raises(ValueError, match="over the runner's limits"):
        host_overheads(runner, [(96, 1)], warmup=0, repeats=1)


def test_prompt_lens_absorb_the_decodes_during_prefill():
    assert prompt_lens([50, 60, 70], budget=1000) == [49, 59, 69]  # one prefill step: no growth
    # budget 64: prompt 0 is prefilled in step 0 of 3 and decodes in the 2 others, prompt 1 in step 1 of 3
    got = prompt_lens([64, 64, 64], budget=64)
    assert got[-1] == 63 and got[0] < got[1] < got[2] and min(got) >= 1
    assert prompt_lens([2, 2], budget=1) == [1, 1]  # never below one token


def test_decode_periods_hold_the_batch_in_an_engine():
    """Each shape's steps run exactly D decodes (else RuntimeError); the runner is left idle."""
    def tiny_runner(blocks):
        return ModelRunner(load_model_config("tiny-qwen3"), CacheConfig(block_size=16, num_gpu_blocks=blocks,
                                                                         swap_space=0),
                           max_num_batched_tokens=96, max_num_seqs=9, max_model_len=128, device="cpu")
    runner = tiny_runner(64)
    periods = decode_periods(runner, [(1, 8), (8, 40)], warmup=1, repeats=3)
    assert set(periods) == {(1, 8), (8, 40)} and all(0 < t < 0.5 for t in periods.values())
    ahead = decode_periods(runner, [(1, 8), (8, 40)], warmup=1, repeats=3, async_scheduling=True)
    assert set(ahead) == {(1, 8), (8, 40)} and all(0 < t < 0.5 for t in ahead.values())
    assert decode_periods(runner, [(8, 40)], warmup=0, repeats=1)  # the engine was left with nothing in flight
    with pytest.raises(ValueError, match="over the runner's limits"):
        decode_periods(runner, [(10, 8)], warmup=0, repeats=1)
    with pytest.raises(RuntimeError, match="expected 8 decodes only"):  # 480 tokens > 24 blocks of 16
        decode_periods(tiny_runner(24), [(8, 60)], warmup=0, repeats=1)


def test_prefill_pair_fit_recovers_the_slope():
    k = 3e-9
    points = [(p, pairs, 1e-3 * p / 1024 + k * pairs) for p in (1024, 2048)
              for pairs in (p * p // 2, p * p // 4, p * p // 8)]
    used, slope, se = fit_prefill_pair_s(points)
    assert used == pytest.approx(k, rel=1e-9) and slope == pytest.approx(k, rel=1e-9) and se < 1e-15
    assert fit_prefill_pair_s([(8, 10, 1.0), (8, 20, 0.5), (8, 30, 0.2)])[0] == 0.0  # negative: not used
    rng = random.Random(1)  # pure noise of 5 ms on a 50 ms plateau: the slope is not significant
    noisy = [(p, pairs, 0.05 + rng.gauss(0, 0.005)) for p in (1024, 2048) for pairs in (p * p // 2, p * p // 4,
                                                                                           p * p // 8, p * p // 16)]
    used, slope, se = fit_prefill_pair_s(noisy)
    assert used == 0.0 and abs(slope) < 2 * se


def _synthetic_file(tmp_path, fn, meta=None, prefill=(0, 128, 512), decode=(0, 1, 16, 64), ctx=(64, 512)):
    rows = [{"kind": "step", "num_prefill_tokens": p, "num_decode_seqs": d, "num_context_tokens": d * c,
             "time_s": fn(p, d, c)} for p in prefill for d in decode for c in (ctx if d else [0])]
    rows += [{"kind": "swap", "num_blocks": n, "time_s": 1e-5 * n} for n in (1, 8)]
    base = {"model": "qwen3-0.6b", "block_size": 16, "device": "synthetic"}
    return write_profile(tmp_path / "p.csv", {**base, **(meta or {})}, rows)


def test_profiled_model_is_exact_at_grid_points_and_monotone_between(tmp_path):
    def fn(p, d, c):  # increasing in every axis, with a kink so interpolation is not trivially exact
        return 1e-3 + 4e-6 * p + 2e-9 * p * p + 3e-5 * d ** 0.7 + 1e-9 * d * c + 2e-8 * p * d
    path = _synthetic_file(tmp_path, fn)
    model = ProfiledModel(path, block_size=16)
    for p, d, c in itertools.product((0, 128, 512), (0, 1, 16, 64), (64, 512)):
        assert model.lookup(p, d, d * c) == pytest.approx(fn(p, d, c if d else 0), rel=1e-6)
    rng = random.Random(0)
    for _ in range(200):
        p, d, c = rng.randrange(0, 600), rng.randrange(0, 70), rng.randrange(64, 512)
        t = model.lookup(p, d, d * c)
        assert model.lookup(p + rng.randrange(1, 50), d, d * c) >= t
        assert model.lookup(p, d + 1, (d + 1) * c) >= t
        assert d == 0 or model.lookup(p, d, d * (c + rng.randrange(1, 50))) >= t


def test_pair_correction_and_graph_buckets(tmp_path):
    fn = lambda p, d, c: 1e-3 + 1e-6 * p + 1e-5 * d + 1e-9 * d * c
    path = _synthetic_file(tmp_path, fn, {"prefill_pair_s": "1e-9", "decode_graph_sizes": "1 2 4 8 16 32 48 64"})
    model = ProfiledModel(path, block_size=16)
    one = synthetic_step(StepShape(256, 1, 0, 0), 16, 1000, 256)
    four = synthetic_step(StepShape(256, 4, 0, 0), 16, 1000, 256)
    pairs_one, pairs_four = BatchShape.of(one).prefill_attention_pairs, BatchShape.of(four).prefill_attention_pairs
    assert model.step_time(one) == pytest.approx(model.lookup(256, 0, 0))  # the profile's own layout
    assert model.step_time(four) == pytest.approx(model.lookup(256, 0, 0) - 1e-9 * (pairs_one - pairs_four))
    dec = synthetic_step(StepShape(0, 0, 20, 100), 16, 1000, 256)  # 20 decodes run the 32-graph
    assert model.step_time(dec) == pytest.approx(model.lookup(0, 32, 2000))
    mixed = synthetic_step(StepShape(128, 1, 20, 100), 16, 1000, 256)  # eager: no padding
    assert model.step_time(mixed) == pytest.approx(model.lookup(128, 20, 2000))
    bad = _synthetic_file(tmp_path, fn, {"prefill_pair_s": "-1"})
    with pytest.raises(ValueError, match="prefill_pair_s"):
        ProfiledModel(bad, block_size=16)


def test_calibration_recovers_known_roofline_parameters(tmp_path, request):
    root = request.config.rootpath
    model = ModelShape.from_dict(yaml.safe_load((root / "conf/model/qwen3-0.6b.yaml").read_text()))
    base_cfg = yaml.safe_load((root / "conf/hardware/h200.yaml").read_text())
    truth = Hardware.from_dict({**base_cfg, "bandwidth_efficiency": 0.6, "gemm_efficiency": 0.45,
                                "attention_efficiency": 0.3, "step_overhead_s": 2e-3})
    roof = RooflineModel(model, truth, 16)
    grid = ProfileGrid.from_dict({"prefill_tokens": [0, 256, 1024, 2048], "decode_seqs": [0, 1, 32, 256],
                                  "context_per_decode": [64, 1024, 4096], "swap_blocks": [1],
                                  "split_prefill_tokens": [256], "split_counts": [1]})
    rows = []
    for s in grid.step_shapes():
        shape = BatchShape(s.num_prefill_tokens, 1 if s.num_prefill_tokens else 0, 0, s.prefill_attention_pairs,
                           s.num_decode_seqs, s.num_context_tokens, s.num_decode_seqs + (1 if s.num_prefill_tokens else 0))
        rows.append({"kind": "step", "num_prefill_tokens": s.num_prefill_tokens, "num_decode_seqs": s.num_decode_seqs,
                     "num_context_tokens": s.num_context_tokens, "time_s": roof.shape_time(shape)})
    rows += [{"kind": "swap", "num_blocks": n, "time_s": roof.swap_time(n)} for n in (1, 16, 256)]
    path = write_profile(tmp_path / "h200-qwen3-0.6b.csv", {"model": "qwen3-0.6b", "block_size": 16}, rows)
    assert len(profile_points(path)[1]) == len(grid.step_shapes())
    values, report = calibrate(path, root / "conf/hardware/h200.yaml")
    fitted = Hardware.from_dict(values)  # the roofline model accepts the fitted values
    errors = [RooflineModel(model, fitted, 16).shape_time(s) / t - 1 for s, t in profile_points(path)[1]]
    assert max(abs(e) for e in errors) < 0.01, report
    assert values["step_overhead_s"] == pytest.approx(2e-3, rel=0.05)
    assert values["swap_latency_s"] == pytest.approx(truth.swap_latency_s, rel=0.01, abs=1e-7)
    target = tmp_path / "h200-calibrated.yaml"
    calibrate_to_file(path, root / "conf/hardware/h200.yaml", target, "pytest")
    assert Hardware.from_dict(yaml.safe_load(target.read_text())).gemm_efficiency == values["gemm_efficiency"]


def test_gpu_slug_uses_the_hardware_names():
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_slug("Some Other GPU 9000") == "some-other-gpu-9000"


@pytest.mark.parametrize("extra, match", [
    (["profile_grid.decode_seqs=[0,4]"], "max_num_seqs - 1 = 3"),
    (["profile_grid.prefill_tokens=[0,40]", "profile_grid.split_prefill_tokens=[40]", "max_num_batched_tokens=40"],
     "max_num_batched_tokens=40"),
    (["passes=0"], "passes=0 is invalid: must be an integer >= 1"),
])
def test_profiler_rejects_step_shapes_the_engine_never_runs(tmp_path, extra, match):
    """A decode count that leaves no room for the prefill beside it, or prefill + decodes over the
    token budget, would be timed eagerly (off the CUDA graphs) and skew the interpolation."""
    with pytest.raises(ValueError, match=match):
        tiny_profile(tmp_path / "p.csv", extra)


def test_step_phases_add_up_on_cpu():
    from experiments.lab.step_phases import PHASES, run
    rows = run("tiny-qwen3", decodes=3, context=20, builds=1, windows=2, steps=3, pause_s=0.0, device="cpu")
    assert [(r["build"], r["window"]) for r in rows] == [(0, 0), (0, 1)]
    for r in rows:
        assert all(r[p] > 0 for p in ("plan", "write+launch", "total")) and r["replay_gpu"] == 0.0
        # medians of parts need not add up exactly, but none exceeds the whole by much
        assert max(r[p] for p in PHASES[:-1]) <= 2 * r["total"]


def test_host_check_times_every_core_and_the_unpinned_process():
    import os

    from experiments.lab.host_check import run, system_facts
    table = run(rounds=2, samples=2)
    cores = sorted(os.sched_getaffinity(0))
    assert len(table) == 2 * (len(cores) + 1)
    assert set(table["core"]) == {*cores, "any"} and (table["median_us"] > 0).all()
    assert (table["min_us"] <= table["median_us"]).all() and (table["median_us"] <= table["max_us"]).all()
    assert sorted(os.sched_getaffinity(0)) == cores  # the process is unpinned again
    assert system_facts()["cpus"] == str(os.cpu_count())


def test_profiler_records_the_tensor_parallel_size_and_the_simulator_checks_it(tmp_path):
    path, _ = tiny_profile(tmp_path / "cpu-tiny-qwen3-tp2.csv", ["tensor_parallel_size=2"])
    assert not torch.distributed.is_initialized()  # the profiler closed its workers
    assert read_profile(path)[0]["tensor_parallel_size"] == "2"
    assert ProfiledModel(path, 16, tensor_parallel_size=2).meta["model"] == "tiny-qwen3"
    with pytest.raises(ValueError, match="measured with tensor_parallel_size=2"):
        ProfiledModel(path, 16)


def test_profiler_measures_the_batch_shape_axis_on_decode_only_rows(tmp_path):
    """With profile_grid.context_ratios the decode-only rows of 2+ sequences are measured once per
    ratio (their longest decode that many times the mean) and written in the context_ratio column;
    the simulator then prices a step from its longest context."""
    path, _ = tiny_profile(tmp_path / "cpu-tiny-qwen3.csv", ["profile_grid.context_ratios=[1,3]"])
    _, rows = read_profile(path)
    steps = [r for _, r in rows if r["kind"] == "step"]
    ratios = {(r["num_prefill_tokens"], r["num_decode_seqs"], r["num_context_tokens"], r["context_ratio"])
              for r in steps}
    decode_rows = {x for x in ratios if x[0] == "0" and x[1] == "2"}
    assert {(c, float(r)) for _, _, c, r in decode_rows} == {("8", 1.0), ("8", 3.0), ("32", 1.0), ("32", 3.0)}
    assert all(r == "" for p, d, _, r in ratios if p != "0" or d != "2")  # they stand for every ratio
    model = ProfiledModel(path, 16, "tiny-qwen3", async_scheduling=True)
    assert model.uses_longest_context and model.axes.ratio == [1.0, 3.0]
