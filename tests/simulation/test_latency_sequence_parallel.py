"""The operator model prices the engine's sequence-parallel steps (`parallel.sequence_parallel_min_rows`,
sim/latency/sequence_parallel_pricing.py): an eager step of that many tokens or more costs its
boundaries' fused rows (or, with symmetric memory off, the collectives beside the GEMMs), its norms on
T/N rows and no all-reduce; the CUDA-graph token buckets stop below the setting as the engine's do;
a profile without the rows, and a model that does not price the path (the profiled one), are refused
by name.

Synthetic profile: the roofline's operators for datasheet H200s, plus rows at N=2 that are
multilinear in (m, k, n) and linear in bytes, so the grids interpolate them exactly."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.device.cuda_graph import graph_token_sizes
from experiments.lib import factory
from experiments.profiles.synthetic_operators import synthetic_operator_profile
from sim.latency.operator_file import write_operator_file
from sim.latency.operator_profile import OperatorProfile, find_operator_files
from sim.latency.sequence_parallel_pricing import FUSED_FAMILY, GEMM_FAMILY, ROW_COLLECTIVES
from tests.simulation.test_latency_operators_fused_boundary import (  # the same model, run and shapes
    COLLECTIVES_FILE,
    HIDDEN,
    LAYERS,
    config,
    decode,
    prefill,
    run,
)

Q, KV, INTER = 2048, 512, 6144  # Qwen3-8B's shard at N=2: q and k/v widths, MLP columns
M, K, N = [256, 1024, 2048, 4096, 8192, 16384], [1024, 2048, 4096, 8192], [1024, 4096, 16384]


def agmm_s(m: float, k: float, n: float) -> float:
    return 3e-6 + m * k * n * 2 / 6e14


def mmrs_s(m: float, k: float, n: float) -> float:
    return 4e-6 + m * k * n * 2 / 5e14


def reduce_scatter_s(nbytes: float) -> float:
    return 6e-6 + nbytes / 2e11


def _profile(out: Path, fused_rows: bool = True, recorded: str | None = None) -> Path:
    synthetic_operator_profile(factory.hardware(config("hardware=h200")), out)
    rows = [{"op": "reduce_scatter", "bytes": 2**i, "world_size": 2, "time_s": reduce_scatter_s(2**i)}
            for i in range(10, 31)]
    if fused_rows:
        rows += [{"op": op, "m": m, "k": k, "n": n, "world_size": 2, "time_s": f(m, k, n)}
                 for op, f in (("all_gather_matmul", agmm_s), ("matmul_reduce_scatter", mmrs_s))
                 for m in M for k in K for n in N]
    meta = {"gpu": "h200-roofline", "device": "synthetic (roofline formulas of h200)", "dtype": "bfloat16",
            "kernels": "collectives", "versions": "none", "date": "computed", "grid": "{}"}
    if recorded is not None:
        meta["sequence_parallel_ops"] = recorded
    write_operator_file(out / COLLECTIVES_FILE, meta, rows)
    return out


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    return _profile(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def no_fused_rows(tmp_path_factory) -> Path:
    return _profile(tmp_path_factory.mktemp("sp-plain"), fused_rows=False)


def grids(directory: Path):
    profile = OperatorProfile.load(find_operator_files(directory, "h200-roofline", "bfloat16"))
    return {"norm": profile.grid("add_rms_norm").fix("n", HIDDEN), "emb": profile.grid("embedding").fix("n", HIDDEN),
            "silu": profile.grid("silu_and_mul").fix("n", INTER), "gemm": profile.grid("gemm"),
            "rope": profile.grid("qk_rope_write").fixed(head_dim=128, num_kv_heads=4, group=4),
            "gather": profile.grid("all_gather", 2)}


@pytest.mark.parametrize("tokens", [4096, 4097])
def test_a_step_from_the_setting_costs_its_fused_boundaries_norms_on_its_rows_and_no_all_reduce(rows, tokens):
    sp = run(rows, "parallel.sequence_parallel_min_rows=2048")
    parts: dict[str, float] = {}
    total = sp.shape_time(prefill(tokens), parts)
    padded = tokens + tokens % 2
    g = grids(rows)
    boundaries = (agmm_s(padded, HIDDEN, Q + 2 * KV) + mmrs_s(padded, Q, HIDDEN) + agmm_s(padded, HIDDEN, 2 * INTER)
                  + mmrs_s(padded, INTER, HIDDEN))
    assert parts[FUSED_FAMILY] == pytest.approx(LAYERS * boundaries)
    ends = reduce_scatter_s(padded * HIDDEN * 2) + g["gather"](padded * HIDDEN * 2)
    assert parts[ROW_COLLECTIVES] == pytest.approx(ends)
    assert parts["norms, activation, rope, embedding"] == pytest.approx(
        (2 * LAYERS + 1) * g["norm"](padded // 2) + LAYERS * (g["silu"](padded) + g["rope"](tokens)) + g["emb"](padded))
    assert "all-reduce" not in parts and GEMM_FAMILY not in parts
    assert total == pytest.approx(sum(parts.values()))
    # Attention, the LM head and sampling as without the setting.
    off_parts: dict[str, float] = {}
    run(rows).shape_time(prefill(tokens), off_parts)
    for family in ("prefill attention", "lm head, sampler", "all-gather", "launch, host"):
        assert parts[family] == off_parts[family]
    assert off_parts["all-reduce"] > 0
    assert "sequence parallel" in sp.data_sources() and "sequence parallel" not in run(rows).data_sources()


def test_steps_below_the_setting_and_graph_replays_are_priced_as_without_it(rows):
    sp, off = run(rows, "parallel.sequence_parallel_min_rows=2048"), run(rows)
    for shape in (prefill(2047), prefill(16), decode(256)):
        assert sp.shape_time(shape) == off.shape_time(shape)
    # With graphs: token buckets stop below the setting, as the engine's; a decode step of the
    # setting's rows replays its batch graph (captured without the sequence-parallel path).
    graphs = run(rows, "parallel.sequence_parallel_min_rows=256", "latency.cuda_graphs=true",
                 "scheduler.max_num_batched_tokens=16384", "scheduler.max_num_seqs=256")
    assert graphs.token_sizes == graph_token_sizes(16384, 256) and max(graphs.token_sizes) == 255
    plain = run(rows, "latency.cuda_graphs=true", "scheduler.max_num_batched_tokens=16384", "scheduler.max_num_seqs=256")
    assert graphs.shape_time(decode(256)) == plain.shape_time(decode(256))
    assert graphs.shape_time(prefill(4096)) < plain.shape_time(prefill(4096))  # this profile's rows beat all-reduces
    one_gpu = factory.latency_setup(config("parallel.tensor_parallel_size=1", "parallel.sequence_parallel_min_rows=256",
                                           "scheduler.max_num_batched_tokens=16384"))
    assert one_gpu.graph_sizes()[1] == graph_token_sizes(16384)  # one GPU: no sequence-parallel step


def test_without_symmetric_memory_the_collectives_are_priced_beside_the_gemms(rows):
    sp = run(rows, "parallel.sequence_parallel_min_rows=2048", "parallel.disable_custom_all_reduce=true")
    parts: dict[str, float] = {}
    sp.shape_time(prefill(4096), parts)
    g = grids(rows)
    gemms = sum(g["gemm"](4096, k, n) for k, n in ((HIDDEN, Q + 2 * KV), (Q, HIDDEN), (HIDDEN, 2 * INTER),
                                                      (INTER, HIDDEN)))
    assert parts[GEMM_FAMILY] == pytest.approx(LAYERS * gemms)
    per_layer = (g["gather"](4096 * HIDDEN * 2) + reduce_scatter_s(4096 * HIDDEN * 2)
                 + g["gather"](4096 * HIDDEN * 2) + reduce_scatter_s(4096 * HIDDEN * 2))
    ends = reduce_scatter_s(4096 * HIDDEN * 2) + g["gather"](4096 * HIDDEN * 2)
    assert parts[ROW_COLLECTIVES] == pytest.approx(LAYERS * per_layer + ends)
    assert FUSED_FAMILY not in parts
    assert "symmetric memory off" in sp.data_sources()["sequence parallel"]


def test_a_profile_without_the_rows_is_refused_naming_them(no_fused_rows):
    with pytest.raises(ValueError, match=r"sequence_parallel_min_rows=2048: operator profile .* lacks "
                                         r"\['all_gather_matmul', 'matmul_reduce_scatter'\] at N=2.*"
                                         r"operator_grid.sequence_parallel_m"):
        run(no_fused_rows, "parallel.sequence_parallel_min_rows=2048")
    run(no_fused_rows, "parallel.sequence_parallel_min_rows=2048", "parallel.disable_custom_all_reduce=true")


def test_models_that_do_not_price_it_and_bad_values_are_refused(rows):
    with pytest.raises(ValueError, match="sequence_parallel_min_rows=2048 is invalid with latency=profiled"):
        factory.build_latency(config("latency=profiled", "latency.path=experiments/profiles/example-synthetic.csv",
                                     "hardware=h200", "model=qwen3-8b",
                                     "parallel.tensor_parallel_size=2", "parallel.sequence_parallel_min_rows=2048"))
    factory.build_latency(config("latency=roofline", "hardware=h200", "model=qwen3-8b",
                                 "parallel.sequence_parallel_min_rows=2048"))  # one GPU: nothing to price
    for bad, shown in (("-1", "-1"), ("true", "True"), ("1.5", "1.5"), ("false", "False"), ("0.0", "0.0")):
        with pytest.raises(ValueError, match=rf"sequence_parallel_min_rows={shown} is invalid: an integer >= 0"):
            run(rows, f"parallel.sequence_parallel_min_rows={bad}")
        with pytest.raises(ValueError, match=rf"^parallel\.sequence_parallel_min_rows={shown} is invalid: an "):  # roofline
            factory.build_latency(config("latency=roofline", "hardware=h200", "model=qwen3-8b",
                                         f"parallel.sequence_parallel_min_rows={bad}"))


def test_the_engine_keeps_its_symmetric_memory_for_a_dtype_its_all_reduce_kernels_do_not_take():
    """float16: every all-reduce on NCCL, but the group still maps its peers' memory, so the engine's
    sequence-parallel steps run the fused ops (engine/distributed/parallel_state.py `init_group`)."""
    engine = factory.engine_all_reduce(config("model=qwen3-8b", "model.dtype=float16", "parallel.tensor_parallel_size=2"))
    assert engine.off_reason is not None and "float16" in engine.off_reason and engine.symmetric_memory
    off = factory.engine_all_reduce(config("model=qwen3-8b", "parallel.tensor_parallel_size=2",
                                           "parallel.disable_custom_all_reduce=true"))
    assert not off.symmetric_memory


def test_a_setting_below_the_rows_measured_is_refused_not_priced_at_the_smallest(rows):
    with pytest.raises(ValueError, match=r"sequence_parallel_min_rows=128 is invalid with this profile: its "
                                         r"all_gather_matmul rows at N=2 start at m=256"):
        run(rows, "parallel.sequence_parallel_min_rows=128")
    assert run(rows, "parallel.sequence_parallel_min_rows=255").sequence_parallel is not None  # 256 rows, padded


@pytest.mark.parametrize(("recorded", "outcome"), [
    ('{"2":"fused"}', "priced"), ('{"4":"plain"}', "not recorded"), (None, "not recorded"),
    ('{"2":"plain"}', "refused"), ("[2", "bad"), ('{"2":"Fused"}', "bad"), ('{"2":null}', "bad"),
    ('["fused"]', "bad")])
def test_the_rows_implementation_as_the_file_records_it(tmp_path, recorded, outcome):
    directory = _profile(tmp_path, recorded=recorded)
    overrides = ("parallel.sequence_parallel_min_rows=2048",)
    if outcome == "refused":
        with pytest.raises(ValueError, match=r"boundary rows at N=2 \(h200-roofline-bfloat16-collectives-n2.csv\) "
                                             r"timed the plain implementation, and the engine would run torch's fused.*"
                                             r"disable_custom_all_reduce=true"):
            run(directory, *overrides)
    elif outcome == "bad":
        with pytest.raises(ValueError, match=r"metadata sequence_parallel_ops=.* is invalid: a JSON object"):
            run(directory, *overrides)
    else:
        source = run(directory, *overrides).data_sources()["sequence parallel"]
        assert source.endswith(f"({COLLECTIVES_FILE}; their implementation not recorded)") is (outcome != "priced")


def test_unknown_engine_paths_price_the_plain_collectives_and_say_so(rows):
    from sim.latency.operators import OperatorModel

    profile = OperatorProfile.load(find_operator_files(rows, "h200-roofline", "bfloat16"))
    model = OperatorModel(profile, factory.model_shape(config("model=qwen3-8b")), 16, 2, sequence_parallel_min_rows=2048)
    assert "(the engine's paths not known)" in model.data_sources()["sequence parallel"]
    assert not model.sequence_parallel.fused
