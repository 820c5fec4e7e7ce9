"""The operator-level latency model (`latency=operators`): its file schema, every committed operator
profile, agreement with the roofline when its operators are priced by the roofline's own formulas,
decode fast-forward, its errors, the CPU operator profiler and an end-to-end run."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.lib import factory
from experiments.profiles.synthetic_operators import synthetic_operator_profile
from sim.latency import BatchShape, RooflineModel
from sim.latency.operator_file import COLUMNS, read_operator_file, write_operator_file
from sim.latency.operator_profile import OperatorProfile, find_operator_files
from sim.latency.operators import OperatorModel
from sim.latency.tensor_parallel import RingLink
from tests.property_settings import examples

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = sorted((ROOT / "experiments" / "profiles" / "operators").glob("*.csv"))
MODELS = ("qwen3-0.6b", "llama-3.2-1b", "qwen3-8b", "llama-3.1-70b")


def config(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """Operators priced by the roofline's formulas for datasheet H200s (gpu `h200-roofline`)."""
    out = tmp_path_factory.mktemp("ops")
    synthetic_operator_profile(factory.hardware(config("hardware=h200")), out)
    return out


@pytest.fixture(scope="module")
def synthetic_profile(synthetic) -> OperatorProfile:
    return OperatorProfile.load(find_operator_files(synthetic, "h200-roofline", "bfloat16"))


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_every_committed_operator_profile_passes_the_schema(path):
    meta, _ = read_operator_file(path)
    assert path.name.startswith(f"{meta['gpu']}-{meta['dtype']}-")
    profile = OperatorProfile.load([path])  # full grids, medians
    for op, world_size in profile.points:
        grid = profile.grid(op, world_size)
        assert math.isfinite(float(grid.values.max())) and grid.min_time > 0, op


def test_the_committed_profiles_include_a_compute_file_with_every_required_op():
    compute = [p for p in COMMITTED if "-collectives-" not in p.stem]
    assert compute
    for path in compute:
        profile = OperatorProfile.load([path])
        for op in ("gemm", "decode_attention", "prefill_attention", "sampler", "graph_launch"):
            assert profile.has(op), (path.name, op)


def shape(prefill: list[tuple[int, int]], decodes: int, context: int) -> BatchShape:
    p = sum(q for q, _ in prefill)
    return BatchShape(p, len(prefill), sum(c for _, c in prefill),
                      sum(q * c + q * (q + 1) // 2 for q, c in prefill), decodes, decodes * context,
                      decodes + len(prefill), 0, tuple(prefill))


_BUILT: dict[tuple[str, int], tuple[OperatorModel, RooflineModel]] = {}


def both_models(profile: OperatorProfile, model: str, tp: int) -> tuple[OperatorModel, RooflineModel]:
    """The operator and roofline models of `model` on datasheet H200s at `tp` (built once per test run)."""
    if (model, tp) not in _BUILT:
        cfg = config("hardware=h200", f"model={model}", f"parallel.tensor_parallel_size={tp}")
        shape_ = factory.model_shape(cfg)
        _BUILT[model, tp] = (OperatorModel(profile, shape_, 16, tp), RooflineModel(shape_, factory.hardware(cfg), 16, tp))
    return _BUILT[model, tp]


def roofline_time(roofline: RooflineModel, b: BatchShape) -> float:
    """The roofline's step time with its LM head priced as its own GEMM, as the operator model
    prices every GEMM: the roofline takes one max(bytes, FLOPs) over all of a step's GEMMs, so a
    step whose layers are compute-bound and whose LM head (few sampled rows) is memory-bound comes
    out cheaper there by up to the head's weight bytes (a quarter of a 0.6B model's step)."""
    t = roofline.shape_time(b)
    tokens = b.num_prefill_tokens + b.num_decode_seqs
    if not tokens:
        return t
    m, hw = roofline.model, roofline.hardware
    head_s = m.lm_head_params * m.dtype_bytes / (hw.hbm_bandwidth * hw.bandwidth_efficiency)
    layers_c, head_c = tokens * roofline._gemm_s_per_token, b.num_samples * roofline._gemm_s_per_sample
    together = max(roofline._weights_s, layers_c + head_c)
    return t - together + max(roofline._weights_s - head_s, layers_c) + max(head_s, head_c)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@settings(max_examples=examples(15), deadline=None)
@given(prefill_tokens=st.sampled_from([0, 7, 160, 1000, 2048, 8192]), prefix=st.sampled_from([0, 512, 3000]),
       decodes=st.sampled_from([0, 1, 17, 64, 256]), context=st.integers(16, 8000))
def test_roofline_priced_operators_reproduce_the_roofline(synthetic_profile, model, tp, prefill_tokens, prefix,
                                                          decodes, context):
    if prefill_tokens == 0 and decodes == 0:
        decodes = 1
    b = shape([(prefill_tokens, prefix)] if prefill_tokens else [], decodes, context)
    ops, roofline = both_models(synthetic_profile, model, tp)
    assert ops.shape_time(b) == pytest.approx(roofline_time(roofline, b), rel=0.05)


def test_several_prefill_chunks_pay_the_launch_floor_once(synthetic_profile):
    cfg = config("hardware=h200", "model=qwen3-8b")
    ops = OperatorModel(synthetic_profile, factory.model_shape(cfg), 16)
    roofline = RooflineModel(factory.model_shape(cfg), factory.hardware(cfg), 16)
    b = shape([(512, 0), (300, 1024), (64, 4000)], 32, 700)
    assert ops.shape_time(b) == pytest.approx(roofline_time(roofline, b), rel=0.05)


def test_decode_fast_forward_matches_step_by_step(synthetic_profile):
    cfg = config("hardware=h200", "model=llama-3.2-1b", "parallel.tensor_parallel_size=2")
    ops = OperatorModel(synthetic_profile, factory.model_shape(cfg), 16, 2)
    times = ops.decode_times(48, 48 * 300, 48, 5)
    assert times == [ops.shape_time(BatchShape(0, 0, 0, 0, 48, 48 * 300 + s * 48, 48)) for s in range(5)]
    assert times == sorted(times) and times[0] < times[-1]


def test_copies_and_swaps_are_priced_by_bytes(synthetic_profile):
    cfg = config("hardware=h200", "model=qwen3-0.6b")
    ops = OperatorModel(synthetic_profile, factory.model_shape(cfg), 16)
    roofline = RooflineModel(factory.model_shape(cfg), factory.hardware(cfg), 16)
    copies = BatchShape(0, 0, 0, 0, 4, 400, 4, 64)
    assert ops.shape_time(copies) == pytest.approx(roofline.shape_time(copies), rel=0.05)
    assert ops.swap_time(0) == 0.0
    assert ops.swap_time(256) == pytest.approx(roofline.swap_time(256), rel=0.1)


def test_a_tensor_parallel_size_without_collectives_names_the_field_and_what_exists(tmp_path):
    compute = [p for p in COMMITTED if p.stem.startswith("cpu-") and "-collectives-" not in p.stem]
    profile = OperatorProfile.load(compute)
    cfg = config("model=tiny-qwen3")
    with pytest.raises(ValueError, match=r"parallel.tensor_parallel_size=2 has no all_reduce data.*world sizes none"):
        OperatorModel(profile, factory.model_shape(cfg), 4, 2)


H200_FILES = [p for p in COMMITTED if p.stem.startswith("h200-bfloat16-")]
H100_COMPUTE = [p for p in COMMITTED if p.stem.startswith("h100-bfloat16-") and "-collectives-" not in p.stem]


def operator_model(files: list[Path], hardware: str, tp: int, collectives: str = "measured") -> OperatorModel:
    return OperatorModel(OperatorProfile.load(files), factory.model_shape(config("model=llama-3.1-70b")), 16, tp,
                         collectives=collectives, hardware=factory.hardware(config(f"hardware={hardware}")))


def test_measured_else_ring_takes_measured_rows_where_they_exist_and_the_ring_model_elsewhere():
    measured = operator_model(H200_FILES, "h200", 2)
    fallback = operator_model(H200_FILES, "h200", 2, "measured_else_ring")
    assert fallback.data_sources()["collectives"] == ("measured at N=2 (h200-bfloat16-collectives-n2-4.csv); "
                                                      "all-reduce: NCCL rows (the engine's all-reduce paths were not "
                                                      "given)")
    for nbytes in (1024, 3 << 20, 1 << 28):
        assert fallback.all_reduce(nbytes) == measured.all_reduce(nbytes)
        assert fallback.all_gather(nbytes) == measured.all_gather(nbytes)
    # N=8 on the same GPU type: the ring model scaled by measured/model at the largest measured
    # size below it (N=4), size by size.
    at4 = operator_model(H200_FILES, "h200", 4, "measured_else_ring")
    assert at4.data_sources()["collectives"].startswith("measured at N=4 (h200-bfloat16-collectives-n2-4.csv)")
    at8 = operator_model(H200_FILES, "h200", 8, "measured_else_ring")
    assert at8.data_sources()["collectives"].startswith("ring model at N=8 x measured/model at N=4 per message size")
    hw = factory.hardware(config("hardware=h200"))
    ring4, ring8 = RingLink.of(hw, 4), RingLink.of(hw, 8)
    for nbytes in OperatorProfile.load(H200_FILES).grid("all_reduce", 4).axes[0].points:
        assert at8.all_reduce(nbytes) == pytest.approx(
            at4.all_reduce(nbytes) * ring8.all_reduce_s(nbytes) / ring4.all_reduce_s(nbytes))
        assert at8.all_gather(nbytes) == pytest.approx(
            at4.all_gather(nbytes) * ring8.all_gather_s(nbytes) / ring4.all_gather_s(nbytes))
    # Large messages keep the bus bandwidth measured at N=4: 2 (N-1)/N of the bytes, 7/6 of N=4's at N=8.
    assert at8.all_reduce(1 << 28) / at4.all_reduce(1 << 28) == pytest.approx(7 / 6, rel=0.01)
    # A GPU type without collective rows: the ring model on the hardware's datasheet figures.
    h100 = operator_model(H100_COMPUTE, "h100", 4, "measured_else_ring")
    assert h100.data_sources()["collectives"].startswith("ring model at N=4 on datasheet figures")
    link = RingLink.of(factory.hardware(config("hardware=h100")), 4)
    for nbytes in (1024, 3 << 20, 1 << 28):
        assert h100.all_reduce(nbytes) == link.all_reduce_s(nbytes)
        assert h100.all_gather(nbytes) == link.all_gather_s(nbytes)
    assert h100.data_sources()["compute"] == "measured (h100-bfloat16-tma.csv)"


def test_collectives_nobody_measured_are_refused_by_default_naming_the_fallback():
    with pytest.raises(ValueError, match=r"parallel.tensor_parallel_size=8 has no all_reduce data.*world sizes "
                                         r"\[2, 4\]; take them on a machine with 8 GPUs .*latency.collectives=measured_else_ring"):
        operator_model(H200_FILES, "h200", 8)
    assert operator_model(H200_FILES, "h200", 4).data_sources()["collectives"].startswith("measured at N=4")
    assert factory.latency_config(config("latency=operators")).collectives == "measured"


@pytest.mark.parametrize("tp", [1, 4])
def test_a_bad_collectives_value_is_refused_with_the_field(tp):
    with pytest.raises(ValueError, match=r"latency.collectives='datasheet' is invalid: one of "
                                         r"\['measured', 'measured_else_ring'\]"):
        operator_model(H200_FILES, "h200", tp, "datasheet")
    cfg = config("latency=operators", "hardware=h200", "model=llama-3.1-70b", f"parallel.tensor_parallel_size={tp}",
                 "latency.collectives=datasheet")
    with pytest.raises(ValueError, match=r"latency.collectives='datasheet' is invalid"):
        factory.build_latency(cfg)


def test_a_gpu_without_operator_data_names_the_field_and_what_exists(synthetic):
    with pytest.raises(ValueError, match=r"latency.gpu='a100' is invalid.*h200-roofline-bfloat16"):
        find_operator_files(synthetic, "a100", "bfloat16")
    with pytest.raises(ValueError, match=r"latency.dtype='float16' is invalid"):
        find_operator_files(synthetic, "h200-roofline", "float16")
    with pytest.raises(ValueError, match=r"latency.kernels='tma' is invalid.*\['roofline'\]"):
        find_operator_files(synthetic, "h200-roofline", "bfloat16", "tma")


def _write(path, meta_extra=None, rows=None, grid='{"m":[1,2]}'):
    meta = {"gpu": "x", "device": "cpu", "dtype": "float32", "kernels": "reference", "versions": "v",
            "date": "d", "grid": grid, **(meta_extra or {})}
    rows = rows if rows is not None else [{"op": "graph_launch", "m": m, "time_s": 1e-5} for m in (1, 2)]
    return write_operator_file(path, meta, rows)


def test_the_schema_check_refuses_bad_files(tmp_path):
    assert read_operator_file(_write(tmp_path / "ok.csv"))[0]["gpu"] == "x"
    with pytest.raises(ValueError, match=r"time_unit='ms' is invalid"):
        read_operator_file(_write(tmp_path / "unit.csv", {"time_unit": "ms"}))
    with pytest.raises(ValueError, match=r"grid.m=\[2, 1\] is invalid: must be strictly increasing"):
        read_operator_file(_write(tmp_path / "grid.csv", grid='{"m":[2,1]}'))
    with pytest.raises(ValueError, match=r"time_s=.* is invalid: seconds"):
        read_operator_file(_write(tmp_path / "t.csv", rows=[{"op": "graph_launch", "m": 1, "time_s": 90.0}]))
    with pytest.raises(ValueError, match=r"op='conv' is invalid"):
        read_operator_file(_write(tmp_path / "op.csv", rows=[{"op": "conv", "m": 1, "time_s": 1e-5}]))
    with pytest.raises(ValueError, match=r"n='' is invalid for op=sampler"):
        read_operator_file(_write(tmp_path / "n.csv", rows=[{"op": "sampler", "m": 1, "time_s": 1e-5}]))
    bad = tmp_path / "cols.csv"
    bad.write_text(_write(tmp_path / "c.csv").read_text().replace(",".join(COLUMNS), "op,m,time_s"))
    with pytest.raises(ValueError, match=r"columns .* are invalid"):
        read_operator_file(bad)
    holes = [{"op": "sampler", "m": m, "n": n, "time_s": 1e-5} for m, n in ((1, 8), (2, 8), (1, 16))]
    with pytest.raises(ValueError, match=r"op=sampler lacks the grid point m=2, n=16"):
        OperatorProfile.load([_write(tmp_path / "holes.csv", rows=holes)])


def test_gemm_cells_the_grid_skipped_at_every_m_come_from_the_fit(tmp_path):
    def seconds(m, k, n):
        return 1e-6 + 1e-12 * k * n + 1e-15 * m * k * n
    rows = [{"op": "gemm", "m": m, "k": k, "n": n, "time_s": seconds(m, k, n)}
            for m in (1, 64, 1024) for k in (256, 1024) for n in (256, 4096) if (k, n) != (1024, 256)]
    grid = OperatorProfile.load([_write(tmp_path / "g.csv", rows=rows)]).grid("gemm")
    for m in (1, 64, 1024):
        assert grid(m, 1024, 256) == pytest.approx(seconds(m, 1024, 256), rel=0.05)


def test_two_files_that_time_one_operator_at_one_world_size_are_refused(tmp_path):
    rows = [{"op": "all_reduce", "bytes": b, "world_size": ws, "time_s": 1e-5} for b in (1024, 8192) for ws in (2, 4)]
    old = _write(tmp_path / "x-float32-collectives-n2.csv", rows=[r for r in rows if r["world_size"] == 2])
    new = _write(tmp_path / "x-float32-collectives-n2-4.csv", rows=rows)
    with pytest.raises(ValueError, match=r"x-float32-collectives-n2.csv and x-float32-collectives-n2-4.csv both "
                                         r"hold op=all_reduce at world_size=2: keep one file"):
        OperatorProfile.load([old, new])
    assert OperatorProfile.load([new]).world_sizes("all_reduce") == [2, 4]


def test_the_committed_files_give_each_gpu_one_file_per_operator_and_world_size():
    by_gpu: dict[str, list[Path]] = {}
    for path in COMMITTED:
        meta, _ = read_operator_file(path)
        by_gpu.setdefault(f"{meta['gpu']}-{meta['dtype']}", []).append(path)
    for paths in by_gpu.values():
        OperatorProfile.load(paths)


def roofline_gemm_s(m: int, k: int, n: int) -> float:
    """A GEMM as a GPU runs one: its weight's read or its FLOPs, whichever is longer, plus a launch."""
    return 3e-6 + max(2 * k * n / 4.8e12, 2 * m * k * n / 7e14)


def test_gemm_cells_skipped_for_their_flops_extrapolate_their_rows_in_m(tmp_path):
    sizes = (1024, 4096, 16384)
    cells = [(m, k, n) for m in (1, 16, 256, 1024, 4096, 16384) for k in sizes for n in sizes]
    rows = [{"op": "gemm", "m": m, "k": k, "n": n, "time_s": roofline_gemm_s(m, k, n)}
            for m, k, n in cells if 2 * m * k * n <= 1e12]
    grid = OperatorProfile.load([_write(tmp_path / "g.csv", rows=rows)]).grid("gemm")
    for m, k, n in cells:
        if 2 * m * k * n > 1e12:
            assert grid(m, k, n) == pytest.approx(roofline_gemm_s(m, k, n), rel=0.02), (m, k, n)


GPU_COMPUTE = [p for p in COMMITTED if "-collectives-" not in p.stem and not p.stem.startswith("cpu-")]


@pytest.mark.parametrize("path", GPU_COMPUTE, ids=lambda p: p.name)
def test_no_filled_gemm_cell_of_a_gpu_is_faster_than_its_fastest_measured_one(path):
    profile = OperatorProfile.load([path])
    measured = {c: min(t) for c, t in profile.points[("gemm", 1)].items()}
    peak = max(2 * m * k * n / t for (m, k, n), t in measured.items())
    grid = profile.grid("gemm")
    points = [axis.points for axis in grid.axes]
    for m in points[0]:
        for k in points[1]:
            for n in points[2]:
                if (m, k, n) not in measured:
                    assert 2 * m * k * n / grid(m, k, n) <= peak * (1 + 1e-9), (m, k, n)


@pytest.mark.slow
def test_the_cpu_operator_profiler_writes_files_the_model_reads(tmp_path):
    from experiments.profile import profile_operators
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="profile", overrides=[
            "mode=operators", "operator_grid=tiny", "device=cpu", f"operators_dir={tmp_path}", "progress=false"])
    paths = profile_operators(cfg, "test")
    assert [p.name for p in paths] == ["cpu-float32-reference.csv", "cpu-float32-collectives-n2.csv"]
    profile = OperatorProfile.load(find_operator_files(tmp_path, "cpu", "float32"))
    # The tiny grid's sequence_parallel_m: the boundaries' rows, beside the reduce-scatter's.
    assert all(profile.has(op, 2) for op in ("reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter"))
    assert profile.meta[1]["sequence_parallel_ops"] == '{"2":"plain"}'  # gloo: the collective beside the GEMM
    model = OperatorModel(profile, factory.model_shape(config("model=tiny-qwen3")), 4, 2)
    assert 0 < model.shape_time(shape([(16, 8)], 3, 20)) < 1.0


@pytest.mark.slow
def test_the_cpu_collectives_skip_the_symmetric_and_fused_rows_and_say_so():
    import torch

    from experiments.lib.profiling.collectives import collective_rows
    said: list[str] = []
    rows = collective_rows([2], [1024, 65536], torch.float32, False, said.append, iters=2, timeout_s=60.0, width=32)
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter"}  # no boundaries
    assert len(said) == 1
    assert ("NCCL rows only, no symmetric-memory rows: no all_reduce_add_rms_norm rows (the simulator prices the "
            "fused boundary as all-reduce + add_rms_norm at N=2): the engine said: all-reduce: NCCL/gloo") in said[0]


def test_experiments_run_with_operators_end_to_end(synthetic, tmp_path):
    from tests.runs.test_experiments_run import cli
    res = cli("latency=operators", f"latency.dir={synthetic}", "latency.gpu=h200-roofline", "hardware=h200",
              "model=qwen3-8b", "parallel.tensor_parallel_size=2", "workload.num_requests=20", "progress=false",
              "plots=false", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "output throughput" in res.stdout
    run = json.loads((tmp_path / "run" / "summary.json").read_text())["run"]
    assert run["latency_data"]["collectives"].startswith("measured at N=2 (h200-roofline-bfloat16-roofline.csv")
    bad = cli("latency=operators", f"latency.dir={synthetic}", "hardware=h200", "workload.num_requests=5",
              "progress=false", f"hydra.run.dir={tmp_path}/bad", cwd=tmp_path)
    assert bad.returncode != 0 and "latency.gpu='h200' is invalid" in bad.stderr


def test_the_default_grid_covers_every_model_at_every_tensor_parallel_size():
    """Without being taken from them: every per-GPU GEMM, width, head shape and vocabulary of the
    real models in conf/model at TP 1/2/4/8 (where the heads divide) lies inside the grid's ranges."""
    import yaml

    from experiments.lib.profiling.operator_grid import OperatorGrid
    from sim.latency.shapes import ModelShape
    from sim.latency.tensor_parallel import shard_shape
    grid = OperatorGrid.from_dict(yaml.safe_load((ROOT / "conf/operator_grid/default.yaml").read_text()))
    OperatorGrid.from_dict(yaml.safe_load((ROOT / "conf/operator_grid/tiny.yaml").read_text()))

    def inside(x, axis):
        return min(axis) <= x <= max(axis)
    checked = 0
    for path in sorted((ROOT / "conf/model").glob("*.yaml")):
        if path.stem.startswith("tiny-"):
            continue
        full = ModelShape.from_dict(yaml.safe_load(path.read_text()))
        for tp in (1, 2, 4, 8):
            try:
                m = shard_shape(full, tp)
            except ValueError:
                continue  # heads that do not divide: the engine refuses that size too
            q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
            for k, n in ((m.hidden_size, q + 2 * kv), (q, m.hidden_size), (m.hidden_size, 2 * m.intermediate_size),
                         (m.intermediate_size, m.hidden_size), (m.hidden_size, m.vocab_size)):
                assert inside(k, grid.gemm_k) and inside(n, grid.gemm_n), (path.stem, tp, k, n)
            assert m.head_dim in grid.head_dims and inside(m.num_key_value_heads, grid.kv_heads), (path.stem, tp)
            assert inside(m.num_attention_heads / m.num_key_value_heads, grid.groups), (path.stem, tp)
            assert inside(m.hidden_size, grid.widths) and inside(m.intermediate_size, grid.widths), (path.stem, tp)
            assert inside(full.vocab_size, grid.vocab), (path.stem, tp)
            checked += 1
    assert checked >= 15


def test_steps_are_priced_at_their_cuda_graph_size(synthetic_profile):
    cfg = config("hardware=h200", "model=qwen3-8b")
    plain = OperatorModel(synthetic_profile, factory.model_shape(cfg), 16)
    graphs = OperatorModel(synthetic_profile, factory.model_shape(cfg), 16, token_sizes=[1024, 1536, 2048],
                           batch_sizes=[16, 32])
    mixed = shape([(1020, 0)], 5, 500)  # 1025 tokens run the 1536-token graph
    assert graphs.shape_time(mixed) > plain.shape_time(mixed) + 0.9 * (
        plain.shape_time(shape([(1531, 0)], 5, 500)) - plain.shape_time(mixed))
    decode = shape([], 17, 500)  # 17 sequences run the 32-row graph: memory-bound, a little dearer
    assert plain.shape_time(decode) < graphs.shape_time(decode) < 1.05 * plain.shape_time(decode)
    built = factory.build_latency(config("hardware=h200", "latency=operators", "latency.gpu=cpu",
                                         "latency.dtype=float32", "model=tiny-qwen3"))
    assert built.token_sizes[0] == 16 and built.batch_sizes[:3] == [1, 2, 4]


def test_a_step_not_scheduled_ahead_waits_for_the_host(synthetic_profile):
    from types import SimpleNamespace

    from policies.outputs import ScheduledSeq, SchedulerOutput
    shape_ = factory.model_shape(config("model=qwen3-0.6b"))
    seqs = [ScheduledSeq(SimpleNamespace(num_computed_tokens=300 + i), 1, 1) for i in range(8)]
    ahead, waited = SchedulerOutput(0.0, list(seqs), ahead=True), SchedulerOutput(0.0, list(seqs))
    overlapped = OperatorModel(synthetic_profile, shape_, 16, sync_host_s=4e-4, sync_host_per_seq_s=1e-5)
    assert overlapped.step_time(waited) == pytest.approx(overlapped.step_time(ahead) + 4e-4 + 8 * 1e-5)
    assert overlapped.decode_times(8, 2436, 8, 3)[0] == pytest.approx(overlapped.step_time(ahead))
    sync = OperatorModel(synthetic_profile, shape_, 16, sync_host_s=4e-4, sync_host_per_seq_s=1e-5,
                         async_scheduling=False)
    assert sync.step_time(ahead) == sync.step_time(waited) == pytest.approx(overlapped.step_time(waited))
    assert sync.decode_times(8, 2436, 8, 3)[0] == pytest.approx(sync.step_time(waited))
    with pytest.raises(ValueError, match=r"latency.sync_host_s=-1 is invalid"):
        OperatorModel(synthetic_profile, shape_, 16, sync_host_s=-1)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_steps_parts_by_operator_family_add_up_to_its_time(tp):
    model = operator_model(H200_FILES, "h200", tp)
    mixed = BatchShape(num_prefill_tokens=1500, num_prefill_seqs=1, prefill_attention_pairs=1500 * 1501 // 2,
                       num_decode_seqs=100, num_context_tokens=100 * 700, num_samples=101, num_copies=2,
                       prefill_chunks=((1500, 0),), max_context_tokens=900)
    decode = BatchShape(num_decode_seqs=256, num_context_tokens=256 * 800, num_samples=256)
    for shape, families in ((mixed, {"prefill attention", "decode attention", "copy_blocks"}),
                            (decode, {"decode attention"})):
        parts: dict[str, float] = {}
        total = model.shape_time(shape, parts)
        assert total == model.shape_time(shape)
        assert sum(parts.values()) == pytest.approx(total, rel=1e-12)
        assert families | {"gemm", "lm head, sampler"} <= set(parts)
        assert ("all-reduce" in parts) == ("all-gather" in parts) == (tp > 1)
