"""The operator model prices the engine's fused layer boundary (sim/latency/collective_pricing.py
`price_fused_boundary`): where `all_reduce_kernel` resolves to "triton_fused" (the default at two
GPUs), 2 L of a step's 2 L + 1 all-reduces (every decoder layer's post-attention norm, each next
layer's input norm, the final norm) cost the profile's `all_reduce_add_rms_norm` row in place of
all-reduce + add_rms_norm; at NCCL's sizes and for rows wider than the kernel takes, the engine's
fallback is priced; without the rows, torch's path is priced and the line says so. On a synthetic
profile (the roofline's operators, flat stand-in symmetric-memory and fused rows)."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from experiments.lib import factory
from experiments.profiles.synthetic_operators import synthetic_operator_profile
from sim.latency.base import BatchShape
from sim.latency.build import EngineAllReduce
from sim.latency.collective_pricing import price_collectives, price_fused_boundary
from sim.latency.operator_file import FUSED_ALL_REDUCE, LAMPORT_FUSED_ALL_REDUCE, write_operator_file
from sim.latency.operator_profile import OperatorProfile, find_operator_files

ONE_SHOT_S, TWO_SHOT_S, FUSED_S, LAMPORT_S = 3e-6, 5e-6, 4e-6, 2.5e-6  # flat stand-ins, below the ring model's
HIDDEN, LAYERS = 4096, 36  # Qwen3-8B
KiB, MiB = 2**10, 2**20
COLLECTIVES_FILE = "h200-roofline-bfloat16-collectives-n2.csv"


def config(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _profile(out: Path, fused_width: int | None, lamport: bool = False) -> Path:
    """The roofline's operators for datasheet H200s, with symmetric-memory rows at N=2 and, unless
    `fused_width` is None, fused rows of that width at the symmetric sizes' whole rows (and the
    Lamport kernel's at LAMPORT_S, with `lamport`)."""
    synthetic_operator_profile(factory.hardware(config("hardware=h200")), out)
    sizes = [2**i for i in range(10, 24)]  # 1 KiB .. 8 MiB
    rows = [{"op": op, "bytes": n, "world_size": 2, "time_s": t} for n in sizes
            for op, t in (("all_reduce_one_shot", ONE_SHOT_S), ("all_reduce_two_shot", TWO_SHOT_S))]
    if fused_width is not None:
        row = fused_width * 2
        rows += [{"op": op, "bytes": n, "n": fused_width, "world_size": 2, "time_s": t}
                 for op, t in ((FUSED_ALL_REDUCE, FUSED_S), (LAMPORT_FUSED_ALL_REDUCE, LAMPORT_S))[:1 + lamport]
                 for n in sizes if n >= row and n % row == 0]
    meta = {"gpu": "h200-roofline", "device": "synthetic (roofline formulas of h200)", "dtype": "bfloat16",
            "kernels": "collectives", "versions": "none", "date": "computed", "grid": "{}"}
    write_operator_file(out / COLLECTIVES_FILE, meta, rows)
    return out


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> Path:
    return _profile(tmp_path_factory.mktemp("fused"), HIDDEN)


@pytest.fixture(scope="module")
def with_lamport(tmp_path_factory) -> Path:
    return _profile(tmp_path_factory.mktemp("lamport"), HIDDEN, lamport=True)


@pytest.fixture(scope="module")
def unfused(tmp_path_factory) -> Path:
    return _profile(tmp_path_factory.mktemp("unfused"), None)


@functools.cache
def run(directory: Path, *overrides: str):
    """The operator model of Qwen3-8B at TP=2 on datasheet H200s, eager steps (built once per test run)."""
    return factory.build_latency(config("latency=operators", f"latency.dir={directory}", "latency.gpu=h200-roofline",
                                        "latency.cuda_graphs=false", "hardware=h200", "model=qwen3-8b",
                                        "parallel.tensor_parallel_size=2", *overrides))


def decode(seqs: int) -> BatchShape:
    return BatchShape(0, 0, 0, 0, seqs, seqs * 500, seqs)


def prefill(tokens: int) -> BatchShape:
    return BatchShape(tokens, 1, 0, tokens * (tokens + 1) // 2, 0, 0, 1, 0, ((tokens, 0),))


def norm_s(directory: Path, rows: int) -> float:
    profile = OperatorProfile.load(find_operator_files(directory, "h200-roofline", "bfloat16"))
    return profile.grid("add_rms_norm").fix("n", HIDDEN)(rows)


def test_the_default_at_two_gpus_prices_the_fused_rows_in_place_of_all_reduce_and_norm(fused):
    """`auto` is the Lamport kernel at two GPUs; a profile without its rows prices it from the fused
    kernel's rows and says so."""
    auto, torch_ = run(fused), run(fused, "parallel.all_reduce_kernel=torch")
    # 8 decodes: 8 x 4096 x 2 bytes, one-shot. The 2 L fused boundaries cost the fused row; the
    # embedding's all-reduce and the first layer's input norm stay as they were.
    saved = 2 * LAYERS * (ONE_SHOT_S + norm_s(fused, 8) - FUSED_S)
    assert torch_.shape_time(decode(8)) - auto.shape_time(decode(8)) == pytest.approx(saved)
    parts: dict[str, float] = {}
    assert auto.shape_time(decode(8), parts) == pytest.approx(sum(parts.values()))
    assert parts["all-reduce"] == pytest.approx(ONE_SHOT_S + 2 * LAYERS * FUSED_S)
    assert auto.data_sources()["collectives"].endswith(
        f"; fused boundary: {FUSED_ALL_REDUCE} rows ({COLLECTIVES_FILE}) for the engine's triton_lamport kernel "
        f"(no {LAMPORT_FUSED_ALL_REDUCE} rows at N=2) in place of all-reduce + add_rms_norm, "
        "all-reduce + add_rms_norm at NCCL's sizes")
    # Either fused kernel chosen by name, at a size "auto" leaves to torch's kernels.
    for kernel in ("triton_fused", "triton_lamport"):
        assert run(fused, f"parallel.all_reduce_kernel={kernel}").shape_time(decode(8)) == auto.shape_time(decode(8))


def test_the_lamport_kernel_is_priced_from_its_own_rows_or_else_the_fused_ones_and_says_which(fused, with_lamport):
    lamport = run(with_lamport, "parallel.all_reduce_kernel=triton_lamport")
    fused_kernel = run(with_lamport, "parallel.all_reduce_kernel=triton_fused")
    # The 2 L boundaries of 8 decodes: each at its kernel's row.
    assert fused_kernel.shape_time(decode(8)) - lamport.shape_time(decode(8)) == \
        pytest.approx(2 * LAYERS * (FUSED_S - LAMPORT_S))
    assert f"fused boundary: {LAMPORT_FUSED_ALL_REDUCE} rows ({COLLECTIVES_FILE}) in place of" \
        in lamport.data_sources()["collectives"]
    assert f"fused boundary: {FUSED_ALL_REDUCE} rows ({COLLECTIVES_FILE}) in place of" \
        in fused_kernel.data_sources()["collectives"]
    without = run(fused, "parallel.all_reduce_kernel=triton_lamport")  # no rows of its own: the fused kernel's
    assert without.shape_time(decode(8)) == run(fused).shape_time(decode(8))
    assert (f"{FUSED_ALL_REDUCE} rows ({COLLECTIVES_FILE}) for the engine's triton_lamport kernel (no "
            f"{LAMPORT_FUSED_ALL_REDUCE} rows at N=2)") in without.data_sources()["collectives"]


def test_torchs_kernels_are_priced_without_the_fused_rows(fused, unfused):
    torch_ = run(fused, "parallel.all_reduce_kernel=torch")
    assert torch_.fused_boundary is None and "fused boundary" not in torch_.data_sources()["collectives"]
    for shape in (decode(8), decode(200), prefill(3000)):
        assert torch_.shape_time(shape) == run(unfused, "parallel.all_reduce_kernel=torch").shape_time(shape)
    triton = run(fused, "parallel.all_reduce_kernel=triton")  # Triton's unfused kernels: torch's rows
    assert triton.shape_time(decode(8)) == torch_.shape_time(decode(8))
    assert "torch's kernels' rows for the engine's triton kernels" in triton.data_sources()["collectives"]


def test_messages_the_engine_sends_through_nccl_are_priced_unfused(fused):
    auto, torch_ = run(fused), run(fused, "parallel.all_reduce_kernel=torch")
    # 8 MiB (1024 rows) is the largest symmetric message; 1025 rows and up go through NCCL, unfused.
    assert auto.fused_boundary(1024 * HIDDEN * 2) == pytest.approx(FUSED_S)
    assert auto.fused_boundary(1025 * HIDDEN * 2) is None
    assert auto.shape_time(prefill(3000)) == pytest.approx(torch_.shape_time(prefill(3000)))
    assert auto.shape_time(prefill(1000)) < torch_.shape_time(prefill(1000))
    # The run's thresholds move the fallback as they move the engine's.
    small = run(fused, "parallel.custom_all_reduce_one_shot_max_bytes=65536", "parallel.custom_all_reduce_max_bytes=65536")
    assert small.fused_boundary(8 * HIDDEN * 2) == pytest.approx(FUSED_S)
    assert small.fused_boundary(9 * HIDDEN * 2) is None


def test_a_profile_without_fused_rows_prices_torchs_path_and_says_so(unfused):
    auto, torch_ = run(unfused), run(unfused, "parallel.all_reduce_kernel=torch")
    assert auto.fused_boundary is None
    assert auto.shape_time(decode(8)) == torch_.shape_time(decode(8))
    assert auto.data_sources()["collectives"].endswith(
        f"; fused boundary: priced as all-reduce + add_rms_norm (no {FUSED_ALL_REDUCE} rows in this profile at N=2; "
        "the engine fuses them: take them with python -m experiments.profile mode=operators "
        "operator_parts=[collectives])")


def test_rows_wider_than_the_kernel_takes_or_of_another_width_are_priced_unfused(fused):
    profile = OperatorProfile.load(find_operator_files(fused, "h200-roofline", "bfloat16"))
    priced = price_collectives(profile, 2)
    engine = factory.engine_all_reduce(config("model=qwen3-8b", "parallel.tensor_parallel_size=2"))
    assert price_fused_boundary(profile, 2, priced, engine, HIDDEN)[0] is not None
    seconds, line = price_fused_boundary(profile, 2, priced, engine, 20480)
    assert seconds is None and line == ("fused boundary: priced as all-reduce + add_rms_norm, as the engine runs rows "
                                        "of 20480 elements (wider than its fused kernel takes)")
    seconds, line = price_fused_boundary(profile, 2, priced, engine, 5120)
    assert seconds is None and line == (
        f"fused boundary: priced as all-reduce + add_rms_norm (the {FUSED_ALL_REDUCE} rows at N=2 are [4096] wide, "
        "the model's rows 5120; the engine fuses them: take them at operator_grid.fused_norm_width=5120)")
    nccl_only = EngineAllReduce(lambda n: "nccl", 0, 0, "disable_custom_all_reduce is set", "triton_fused")
    assert price_fused_boundary(profile, 2, priced, nccl_only, HIDDEN) == (None, None)


def test_the_engines_kernel_rule_decides_from_the_run_config():
    at2 = factory.engine_all_reduce(config("model=qwen3-8b", "parallel.tensor_parallel_size=2"))
    assert at2.kernel == "triton_lamport" and at2.fuses_width(16384) and not at2.fuses_width(16385)
    at4 = factory.engine_all_reduce(config("model=qwen3-8b", "parallel.tensor_parallel_size=4"))
    assert at4.kernel == "torch" and at4.fuses_width is None
    for kernel in ("torch", "triton"):
        named = factory.engine_all_reduce(config("model=qwen3-8b", "parallel.tensor_parallel_size=2",
                                                 f"parallel.all_reduce_kernel={kernel}"))
        assert named.kernel == kernel and named.fuses_width is None
    for kernel in ("triton_fused", "triton_lamport"):  # both fuse the boundary: priced from the fused rows
        fused_at4 = factory.engine_all_reduce(config("model=qwen3-8b", "parallel.tensor_parallel_size=4",
                                                     f"parallel.all_reduce_kernel={kernel}"))
        assert fused_at4.kernel == kernel and fused_at4.fuses_width(4096)


def test_the_fused_op_passes_the_schema_only_with_a_width_and_a_world_size(tmp_path):
    from sim.latency.operator_file import read_operator_file
    meta = {"gpu": "x", "device": "d", "dtype": "bfloat16", "kernels": "collectives", "versions": "v", "date": "d",
            "grid": "{}"}
    ok = [{"op": FUSED_ALL_REDUCE, "bytes": n, "n": 1024, "world_size": 2, "time_s": 1e-5} for n in (2048, 8192)]
    assert OperatorProfile.load([write_operator_file(tmp_path / "ok.csv", meta, ok)]).has(FUSED_ALL_REDUCE, 2)
    with pytest.raises(ValueError, match=rf"n='' is invalid for op={FUSED_ALL_REDUCE}"):
        read_operator_file(write_operator_file(tmp_path / "no_n.csv", meta, [{**ok[0], "n": None}]))
    with pytest.raises(ValueError, match=rf"world_size=1 is invalid for op={FUSED_ALL_REDUCE}: must be >= 2"):
        read_operator_file(write_operator_file(tmp_path / "one.csv", meta, [{**ok[0], "world_size": 1}]))


def test_the_profiler_times_the_fused_rows_at_whole_rows_of_the_grids_width():
    import torch

    from experiments.lib.profiling.collectives import fused_sizes
    from experiments.lib.profiling.operator_grid import OperatorGrid
    # 1 KiB holds no 4096-wide bf16 row; 8 KiB is one row; 12 KiB rounds down to it.
    assert fused_sizes([1024, 8192, 12288, 65536], torch.bfloat16, 2, HIDDEN) == [8192, 65536]
    with initialize_config_module(config_module="conf", version_base="1.3"):
        grid = {**OmegaConf.to_container(compose(config_name="profile").operator_grid), "fused_norm_width": 4096.5}
    with pytest.raises(ValueError, match=r"operator_grid.fused_norm_width=4096.5 is invalid: an integer >= 1"):
        OperatorGrid.from_dict(grid)
