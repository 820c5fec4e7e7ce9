"""The operator model prices the all-reduce the engine runs (sim/latency/collective_pricing.py
`price_engine_all_reduce`): each message on the path the engine's rule picks at the run's
`parallel` settings, from the profile's symmetric-memory rows where it has them, NCCL's rows
otherwise, with `run.latency_data` saying which; and the schema of the symmetric-memory ops."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from experiments.lib import factory
from sim.latency.base import BatchShape
from sim.latency.operator_file import (
    ALL_REDUCE_PATH_OPS,
    FUSED_ALL_REDUCE,
    LAMPORT_FUSED_ALL_REDUCE,
    read_operator_file,
    write_operator_file,
)
from sim.latency.operator_profile import OperatorProfile
from sim.latency.tensor_parallel import RingLink
from tests.simulation.test_latency_operators_fused_boundary import prefill

ROOT = Path(__file__).resolve().parents[2]
OPERATORS = ROOT / "experiments" / "profiles" / "operators"
H200_COLLECTIVES = OPERATORS / "h200-bfloat16-collectives-n2-4.csv"
ONE_SHOT_S, TWO_SHOT_S = 3e-6, 5e-6  # the stand-in rows: flat, below every NCCL row (>= 9 us)
KiB, MiB = 2**10, 2**20
# At two GPUs the engine's default kernels are the fused boundary's ("auto": triton_fused), which
# these profiles have no rows of: torch's rows priced, and the line says so.
TRITON_AT_2 = ", torch's kernels' rows for the engine's triton_lamport kernels"
NO_FUSED_ROWS_AT_2 = ("; fused boundary: priced as all-reduce + add_rms_norm (no all_reduce_add_rms_norm rows in this "
                      "profile at N=2; the engine fuses them: take them with python -m experiments.profile "
                      "mode=operators operator_parts=[collectives])")


def config(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run(directory: Path, *overrides: str):
    return factory.build_latency(config("latency=operators", f"latency.dir={directory}", "hardware=h200",
                                        "model=qwen3-8b", "parallel.tensor_parallel_size=2", *overrides))


def _h200_with_symmetric_rows(out: Path, times: dict[str, float]) -> Path:
    """The committed H200 files in `out`, the collectives file's symmetric-memory rows replaced by
    flat stand-ins at its sizes (`times`: path -> seconds; none: a profile without them), and no
    fused-boundary rows (sim/latency/collective_pricing.py prices those: test_latency_operators_fused_boundary.py)."""
    for path in OPERATORS.glob("h200-bfloat16-*.csv"):
        shutil.copy(path, out)
    meta, rows = read_operator_file(H200_COLLECTIVES)
    dropped = (ALL_REDUCE_PATH_OPS["one-shot"], ALL_REDUCE_PATH_OPS["two-shot"], FUSED_ALL_REDUCE,
               LAMPORT_FUSED_ALL_REDUCE)
    kept = [{"op": op, **row} for op, row in rows if op not in dropped]
    sizes = sorted({row["bytes"] for op, row in rows if op == "all_reduce"})
    world_sizes = sorted({row["world_size"] for op, row in rows})
    extra = [{"op": ALL_REDUCE_PATH_OPS[path], "bytes": n, "world_size": ws, "time_s": t}
             for path, t in times.items() for n in sizes for ws in world_sizes]
    write_operator_file(out / H200_COLLECTIVES.name, meta, kept + extra)
    return out


@pytest.fixture(scope="module")
def symmetric(tmp_path_factory) -> Path:
    """Stand-in one-shot and two-shot rows, below every NCCL row, so each path's price is plain."""
    return _h200_with_symmetric_rows(tmp_path_factory.mktemp("symm"), {"one-shot": ONE_SHOT_S, "two-shot": TWO_SHOT_S})


def test_each_message_is_priced_on_the_path_the_engine_takes(symmetric):
    nccl = OperatorProfile.load([H200_COLLECTIVES]).grid("all_reduce", 2)
    model = run(symmetric)  # the defaults: one-shot up to 1 MiB on 2 GPUs, two-shot up to 8 MiB
    assert model.all_reduce(8 * KiB) == pytest.approx(ONE_SHOT_S) == model.all_reduce(MiB)
    assert model.all_reduce(MiB + 16) == pytest.approx(TWO_SHOT_S) == model.all_reduce(8 * MiB)
    assert model.all_reduce(8 * MiB + 16) == nccl(8 * MiB + 16)
    assert model.all_reduce(6) == nccl(6)  # not whole 4-byte vectors: NCCL, as in the engine
    assert model.data_sources()["collectives"] == (
        "measured at N=2 (h200-bfloat16-collectives-n2-4.csv); all-reduce: the engine's paths, one-shot up to "
        f"1048576 bytes, two-shot up to 8388608 (symmetric-memory rows, h200-bfloat16-collectives-n2-4.csv"
        f"{TRITON_AT_2}), NCCL rows above{NO_FUSED_ROWS_AT_2}")
    # The run's thresholds move the boundaries.
    moved = run(symmetric, "parallel.custom_all_reduce_one_shot_max_bytes=4096",
                "parallel.custom_all_reduce_max_bytes=65536")
    assert moved.all_reduce(4 * KiB) == pytest.approx(ONE_SHOT_S)
    assert moved.all_reduce(8 * KiB) == pytest.approx(TWO_SHOT_S)
    assert moved.all_reduce(128 * KiB) == nccl(128 * KiB)
    # A decode step of 8 sequences: 2 L + 1 all-reduces of 8 x 4096 x 2 bytes, one-shot.
    off = run(symmetric, "parallel.disable_custom_all_reduce=true")
    decode = BatchShape(0, 0, 0, 0, 8, 8 * 500, 8)
    saved = (2 * 36 + 1) * (nccl(8 * 4096 * 2) - ONE_SHOT_S)
    assert off.shape_time(decode) - model.shape_time(decode) == pytest.approx(saved)


def test_with_the_symmetric_paths_off_every_message_is_nccls_and_the_run_says_why(symmetric):
    nccl = OperatorProfile.load([H200_COLLECTIVES]).grid("all_reduce", 2)
    off = run(symmetric, "parallel.disable_custom_all_reduce=true")
    for nbytes in (8 * KiB, 2 * MiB, 64 * MiB):
        assert off.all_reduce(nbytes) == nccl(nbytes)
    assert off.data_sources()["collectives"].endswith(
        "; all-reduce: NCCL rows, as the engine runs it (symmetric memory off: disable_custom_all_reduce is set)")
    zero = run(symmetric, "parallel.custom_all_reduce_max_bytes=0")
    assert zero.all_reduce(8 * KiB) == nccl(8 * KiB)
    assert "symmetric memory off: custom_all_reduce_max_bytes=0" in zero.data_sources()["collectives"]


@pytest.mark.parametrize("tp", [2, 4])
def test_the_committed_h200_profile_prices_the_engines_paths_from_its_own_rows(tp):
    _, rows = read_operator_file(H200_COLLECTIVES)
    measured = {(op, row["bytes"]): row["time_s"] for op, row in rows if row["world_size"] == tp and "bytes" in row}
    model = run(OPERATORS, f"parallel.tensor_parallel_size={tp}", "parallel.all_reduce_kernel=torch")
    one_shot_max = {2: MiB, 4: 512 * KiB}[tp]  # the engine's default bounds at 2 and 4 GPUs
    for nbytes in (8 * KiB, 256 * KiB):
        assert model.all_reduce(nbytes) == pytest.approx(measured[(ALL_REDUCE_PATH_OPS["one-shot"], nbytes)])
    assert model.all_reduce(4 * MiB) == pytest.approx(measured[(ALL_REDUCE_PATH_OPS["two-shot"], 4 * MiB)])
    assert model.all_reduce(64 * MiB) == pytest.approx(measured[("all_reduce", 64 * MiB)])
    path = ALL_REDUCE_PATH_OPS["one-shot" if tp == 2 else "two-shot"]  # 1 MiB: one-shot on 2 GPUs only
    assert model.all_reduce(MiB) == pytest.approx(measured[(path, MiB)])
    assert model.data_sources()["collectives"] == (
        f"measured at N={tp} (h200-bfloat16-collectives-n2-4.csv); all-reduce: the engine's paths, one-shot up to "
        f"{one_shot_max} bytes, two-shot up to 8388608 (symmetric-memory rows, h200-bfloat16-collectives-n2-4.csv), "
        "NCCL rows above")


def test_a_profile_without_symmetric_rows_prices_nccl_and_says_so(tmp_path):
    """A profile taken where symmetric memory was not available: the engine's small messages are
    faster than priced."""
    nccl = OperatorProfile.load([H200_COLLECTIVES]).grid("all_reduce", 2)
    model = run(_h200_with_symmetric_rows(tmp_path, {}))
    for nbytes in (8 * KiB, 2 * MiB, 64 * MiB):
        assert model.all_reduce(nbytes) == nccl(nbytes)
    assert model.data_sources()["collectives"] == (
        "measured at N=2 (h200-bfloat16-collectives-n2-4.csv); all-reduce: NCCL rows (no symmetric-memory rows in "
        "this profile at N=2; the engine's small messages are faster: one-shot up to 1048576 bytes, "
        f"two-shot up to 8388608 over symmetric memory){NO_FUSED_ROWS_AT_2}")


def test_a_world_size_priced_by_the_ring_model_keeps_ncclss_price_and_says_so(symmetric):
    at8 = run(symmetric, "parallel.tensor_parallel_size=8", "latency.collectives=measured_else_ring")
    nccl = OperatorProfile.load([H200_COLLECTIVES]).grid("all_reduce", 4)  # the largest measured size below 8
    hw = factory.hardware(config("hardware=h200"))
    ring4, ring8 = RingLink.of(hw, 4), RingLink.of(hw, 8)
    assert at8.all_reduce(8 * KiB) == pytest.approx(nccl(8 * KiB) * ring8.all_reduce_s(8 * KiB)
                                                    / ring4.all_reduce_s(8 * KiB))
    assert at8.data_sources()["collectives"].endswith(
        "; all-reduce: the ring model (no symmetric-memory pricing at an unmeasured N=8; the engine's "
        "small messages are faster: one-shot up to 262144 bytes, two-shot up to 8388608 over symmetric memory)")


def test_the_engines_rule_decides_from_the_run_config():
    paths = factory.engine_all_reduce(config("model=qwen3-8b", "parallel.tensor_parallel_size=4"))
    assert paths.off_reason is None and (paths.one_shot_max_bytes, paths.two_shot_max_bytes) == (512 * KiB, 8 * MiB)
    assert [paths.path(n) for n in (512 * KiB, 512 * KiB + 16, 8 * MiB + 16)] == ["one-shot", "two-shot", "nccl"]
    half = factory.engine_all_reduce(config("model=qwen3-8b", "model.dtype=float16", "parallel.tensor_parallel_size=2"))
    assert half.off_reason == "model.dtype=float16: the kernels take ['bfloat16', 'float32']"
    assert half.path(8 * KiB) == "nccl"
    with pytest.raises(ValueError, match=r"parallel.custom_all_reduce_max_bytes=1000 is invalid"):
        factory.engine_all_reduce(config("parallel.tensor_parallel_size=2",
                                         "parallel.custom_all_reduce_max_bytes=1000"))


def test_the_symmetric_ops_pass_the_schema_only_with_a_world_size(tmp_path):
    meta = {"gpu": "x", "device": "d", "dtype": "bfloat16", "kernels": "collectives", "versions": "v", "date": "d",
            "grid": "{}"}
    ok = [{"op": "all_reduce_one_shot", "bytes": n, "world_size": 2, "time_s": 1e-5} for n in (1024, 4096)]
    profile = OperatorProfile.load([write_operator_file(tmp_path / "ok.csv", meta, ok)])
    assert profile.has("all_reduce_one_shot", 2) and profile.grid("all_reduce_one_shot", 2)(2048) == pytest.approx(1e-5)
    with pytest.raises(ValueError, match=r"world_size='' is invalid for op=all_reduce_two_shot"):
        read_operator_file(write_operator_file(tmp_path / "none.csv", meta,
                                               [{"op": "all_reduce_two_shot", "bytes": 1024, "time_s": 1e-5}]))
    with pytest.raises(ValueError, match=r"world_size=1 is invalid for op=all_reduce_one_shot: must be >= 2"):
        read_operator_file(write_operator_file(tmp_path / "one.csv", meta,
                                               [{"op": "all_reduce_one_shot", "bytes": 1024, "world_size": 1,
                                                 "time_s": 1e-5}]))


def test_the_profile_names_every_engine_path():
    from engine.distributed.all_reduce_path import NCCL, ONE_SHOT, TWO_SHOT
    assert set(ALL_REDUCE_PATH_OPS) == {ONE_SHOT, TWO_SHOT, NCCL}


def test_the_committed_h200_profile_prices_sequence_parallel_steps_from_its_fused_rows():
    """The N=2 rows of torch's fused ops, timed where the GPUs map each other's memory, are in the
    profile of record with their implementation recorded: a run with the setting takes them, and a
    sequence-parallel step costs what its own calls cost, not the all-reduce path's price."""
    _, rows = read_operator_file(H200_COLLECTIVES)
    assert {op for op, row in rows if row["world_size"] == 2} >= {"all_gather_matmul", "matmul_reduce_scatter",
                                                                  "reduce_scatter"}
    plain = run(OPERATORS)
    sp = run(OPERATORS, "parallel.sequence_parallel_min_rows=2048")
    assert "torch's fused symmetric-memory ops" in sp.data_sources()["sequence parallel"]
    assert "implementation not recorded" not in sp.data_sources()["sequence parallel"]
    assert sp.shape_time(prefill(1024)) == plain.shape_time(prefill(1024))  # below the setting
    assert sp.shape_time(prefill(8192)) != plain.shape_time(prefill(8192))
