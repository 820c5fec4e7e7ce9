"""The collectives profiler's rank worker on the CPU (experiments/lib/profiling/collectives.py): the
ops it times through the engine's group, with the engine's symmetric-memory paths played by a
stand-in for torch's `symm_mem` ops (and the fused boundary by the Triton kernel in the
interpreter, its peers mirrored), and the NCCL-only rows with the engine's reason when the group
has no symmetric paths."""
from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch

import experiments.lib.profiling.collectives as collectives
from engine.distributed.all_reduce_path import ONE_SHOT, TWO_SHOT
from engine.distributed.parallel_state import open_store
from engine.distributed.symmetric_all_reduce import SymmetricAllReduce
from tests.symmetric_memory_helpers import FakeSymmOps, mirrored_peers

SIZES = [1024, 4096, 65536]
WIDTH = 256  # the fused rows' width: 1 KiB rows of float32


def _run_worker(sizes: list[int], dtype: torch.dtype, kernel: str = "triton_fused") -> tuple[list[dict], str]:
    """Rank 0 of a one-process gloo group, in this process (the profiler spawns one per GPU)."""
    store = open_store(1, 10)
    results: queue.Queue = queue.Queue()
    collectives._worker(0, 1, store.port, sizes, dtype, False, 2, 10.0, WIDTH, results, kernel=kernel)
    status, payload = results.get(timeout=1)
    assert status == "ok", payload
    return payload


def test_a_group_with_the_symmetric_paths_times_both_as_ops_of_their_own(monkeypatch):
    ops = FakeSymmOps()
    real_init = collectives.init_group
    buffers = []

    def with_symmetric_paths(store, rank, size, device, timeout_s, parallel):
        """The engine's group, with the symmetric buffer the worker asked for, over the stand-in."""
        group = real_init(store, rank, size, device, timeout_s, parallel)
        nbytes = parallel.custom_all_reduce_max_bytes
        buffers.append(torch.zeros(nbytes, dtype=torch.uint8))
        group.custom = SymmetricAllReduce(buffers[-1], "g", parallel.one_shot_max_bytes(size), nbytes, ops=ops)
        return group

    monkeypatch.setattr(collectives, "init_group", with_symmetric_paths)
    rows, _ = _run_worker(SIZES, torch.float32)
    by_op = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r["bytes"])
    assert by_op == {op: SIZES for op in ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_one_shot",
                                          "all_reduce_two_shot")}
    assert all(r["time_s"] > 0 and r["world_size"] == 1 for r in rows)
    assert buffers[0].numel() == max(SIZES)  # the buffer holds the largest message timed on it
    # Each symmetric op ran its own path, on messages staged in the symmetric buffer.
    paths = {path for path, _ in ops.calls}
    assert paths == {ONE_SHOT, TWO_SHOT}
    assert {ptr for _, ptr in ops.calls} == {buffers[0].data_ptr()}


def test_without_symmetric_memory_the_rows_are_nccls_and_the_engine_says_why():
    rows, said = _run_worker(SIZES, torch.float32)
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert said == "all-reduce: NCCL/gloo for every message (custom all-reduce off: one rank: nothing to reduce)"


def test_a_dtype_the_kernels_do_not_take_gets_no_symmetric_rows():
    assert collectives.symmetric_sizes(SIZES, torch.float16, 2) == []
    assert collectives.symmetric_sizes(SIZES, torch.bfloat16, 2) == SIZES
    assert collectives.symmetric_sizes([2, 1024, 2**31], torch.bfloat16, 1) == [1024]  # whole 4-byte vectors, the limit
    rows, said = _run_worker(SIZES, torch.float16)
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert said == "no message of the grid in torch.float16 is one the symmetric-memory kernels take"


def test_a_group_that_fuses_also_times_the_fused_boundary_and_torchs_kernels_for_the_paths(monkeypatch):
    """The group opened with the Triton kernels (as the profiler opens it): the one-shot / two-shot
    rows still time torch's kernels (the stand-in ops), and the fused rows the fused kernel, at
    each size's whole rows of the width."""
    ops = FakeSymmOps()
    real_init = collectives.init_group
    kept = []

    def fused_group(store, rank, size, device, timeout_s, parallel):
        assert parallel.kernel_for(2) == "triton_fused"
        group = real_init(store, rank, size, device, timeout_s, parallel)
        nbytes = parallel.custom_all_reduce_max_bytes
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        peers, pads = mirrored_peers(buffer)
        kept.extend([buffer, pads])
        group.custom = SymmetricAllReduce(buffer, "g", parallel.one_shot_max_bytes(size), nbytes, ops=ops,
                                          peers=peers, fused=True)
        return group

    monkeypatch.setattr(collectives, "init_group", fused_group)
    rows, _ = _run_worker(SIZES, torch.float32)
    by_op = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append((r["bytes"], r.get("n")))
    assert by_op.pop("all_reduce_add_rms_norm") == [(n, WIDTH) for n in SIZES]
    assert by_op == {op: [(n, None) for n in SIZES]
                     for op in ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_one_shot",
                                "all_reduce_two_shot")}
    assert {path for path, _ in ops.calls} == {ONE_SHOT, TWO_SHOT}  # torch's ops, not the Triton kernels


def test_the_lamport_pass_times_only_its_fused_boundary_each_from_a_forwards_start(monkeypatch):
    """The group opened with the Lamport kernel (its peers mirrored, in the interpreter): one row per
    fused size at the grid's width, each size timed after `begin_forward`, so the graph's rounds go
    0, 1, 2, ... as an engine forward's; no other op is timed in that pass."""
    from engine.distributed.lamport_all_reduce import LamportAllReduce
    from sim.latency.operator_file import LAMPORT_FUSED_ALL_REDUCE
    from tests.symmetric_memory_helpers import mirrored_lamport

    real_init = collectives.init_group
    kept, begins = [], []

    def lamport_group(store, rank, size, device, timeout_s, parallel):
        assert parallel.kernel_for(2) == "triton_lamport"
        group = real_init(store, rank, size, device, timeout_s, parallel)
        nbytes = parallel.custom_all_reduce_max_bytes
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        custom, keep = mirrored_lamport(buffer, nbytes)
        kept.extend([buffer, keep])
        group.custom = custom
        return group

    real_begin = LamportAllReduce.begin_forward
    monkeypatch.setattr(LamportAllReduce, "begin_forward", lambda self: (begins.append(1), real_begin(self))[1])
    monkeypatch.setattr(collectives, "init_group", lamport_group)
    rows, _ = _run_worker(SIZES, torch.bfloat16, kernel="triton_lamport")
    assert [(r["op"], r["bytes"], r["n"]) for r in rows] == [(LAMPORT_FUSED_ALL_REDUCE, n, WIDTH) for n in SIZES]
    assert all(r["time_s"] > 0 and r["world_size"] == 1 for r in rows)
    assert len(begins) == len(SIZES) + 1  # the first size once more, untimed: the process is fresh


def test_a_world_size_with_fused_rows_gets_a_lamport_pass_and_a_failed_one_is_said(monkeypatch):
    """collective_rows: after a world size's rows hold the fused boundary, the Lamport kernel's pass
    runs with its own group (`kernel="triton_lamport"`); its rows join, or the log says why none did."""
    from sim.latency.operator_file import FUSED_ALL_REDUCE, LAMPORT_FUSED_ALL_REDUCE

    fused = {"op": FUSED_ALL_REDUCE, "bytes": 1024, "n": WIDTH, "world_size": 2, "time_s": 1e-5}
    lamport = {**fused, "op": LAMPORT_FUSED_ALL_REDUCE, "time_s": 8e-6}
    outcomes, kernels = [], []

    def fake_run_ranks(target, world, args, timeout_s):
        kernels.append(getattr(target, "keywords", {}).get("kernel", "triton_fused"))
        return outcomes.pop(0)

    monkeypatch.setattr(collectives, "run_ranks", fake_run_ranks)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    said: list[str] = []
    outcomes[:] = [("ok", ([fused], "said")), ("ok", ([lamport], "said"))]
    rows = collectives.collective_rows([2], SIZES, torch.bfloat16, True, said.append)
    assert rows == [fused, lamport] and kernels == ["triton_fused", "triton_lamport"]
    assert said[-1] == f"collectives: world_size=2, 1 {LAMPORT_FUSED_ALL_REDUCE} rows"
    outcomes[:] = [("ok", ([fused], "said")), ("error", "rank 1: it hung")]
    assert collectives.collective_rows([2], SIZES, torch.bfloat16, True, said.append) == [fused]
    assert said[-1].endswith("from the fused kernel's rows): rank 1: it hung")
    outcomes[:] = [("ok", ([{**fused, "op": "all_reduce"}], "said"))]  # no fused rows: no Lamport pass
    collectives.collective_rows([2], SIZES, torch.bfloat16, True, said.append)
    assert kernels[-1] == "triton_fused" and not outcomes


def _tiny_grid(**changes):
    import yaml

    from experiments.lib.profiling.operator_grid import OperatorGrid
    d = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf/operator_grid/tiny.yaml").read_text())
    d.update(changes)
    return OperatorGrid.from_dict({k: v for k, v in d.items() if v is not None})


# The tiny grid's boundary cells in float32: m of [64, 128] x k of [32, 128] x n of [32, 128, 512]
# within 2 m k n <= 2e6 (the compute part's GEMM cap).
TINY_CELLS = [(64, 32, 32), (64, 32, 128), (64, 128, 32), (128, 32, 32), (128, 32, 128), (128, 128, 32)]


def test_sequence_parallel_m_is_optional_and_a_bad_one_is_refused_naming_it():
    assert _tiny_grid().sequence_parallel_m == [64, 128]
    assert _tiny_grid(sequence_parallel_m=None).sequence_parallel_m == []  # left out: no such rows
    assert _tiny_grid(sequence_parallel_m=[]).sequence_parallel_m == []
    for bad in ([128, 64], [64, 64], [0], [64, -1], "64", [64.0], [True]):
        with pytest.raises(ValueError, match=r"operator_grid\.sequence_parallel_m=.* is invalid"):
            _tiny_grid(sequence_parallel_m=bad)


def test_the_boundary_cells_are_the_gemm_cells_the_caps_allow():
    from experiments.lib.profiling.sequence_parallel_rows import cells_at, sequence_parallel_cells
    assert sequence_parallel_cells(_tiny_grid(), 4) == TINY_CELLS
    assert sequence_parallel_cells(_tiny_grid(sequence_parallel_m=None), 4) == []
    # The weight cap (k n bytes) as the compute part's GEMMs: only the 32 x 32 weight fits.
    assert sequence_parallel_cells(_tiny_grid(gemm_max_weight_bytes=32 * 128 * 4 - 1), 4) == [
        (64, 32, 32), (128, 32, 32)]
    assert sequence_parallel_cells(_tiny_grid(gemm_max_weight_bytes=32 * 128 * 2 - 1), 2) == [
        (64, 32, 32), (128, 32, 32)]
    # Outputs wider than 65536 (vocabularies) are no boundary's.
    wide = _tiny_grid(gemm_n=[32, 65536, 131072], gemm_max_flops=1e15, sequence_parallel_m=[64])
    assert sequence_parallel_cells(wide, 4) == [(64, k, n) for k in (32, 128) for n in (32, 65536)]
    assert cells_at(TINY_CELLS, 2) == cells_at(TINY_CELLS, 64) == TINY_CELLS
    assert cells_at(TINY_CELLS, 128) == TINY_CELLS[3:] and cells_at(TINY_CELLS, 3) == []


def test_the_boundary_rows_at_two_ranks_cover_the_cells_and_load_as_a_profile(tmp_path):
    """The boundaries' pass on gloo at two ranks (the plain path, as the engine's group runs it on
    CPUs): one row per op and cell, times > 0, the engine's line on the implementation; a file of
    them loads and interpolates, the cells the caps skipped filled."""
    import json

    from experiments.lib.profiling.sequence_parallel_rows import sequence_parallel_cells
    from sim.latency.operator_file import write_operator_file
    from sim.latency.operator_profile import OperatorProfile

    grid = _tiny_grid()
    said: list[str] = []
    cells = sequence_parallel_cells(grid, 4)
    rows, implementation = collectives.boundary_pass(2, cells, torch.float32, False, 2, 60.0, said.append)
    assert implementation == "plain"
    assert sorted((r["op"], r["m"], r["k"], r["n"]) for r in rows) == sorted(
        (op, *cell) for op in ("all_gather_matmul", "matmul_reduce_scatter") for cell in TINY_CELLS)
    assert all(r["world_size"] == 2 and r["time_s"] > 0 for r in rows)
    assert said == [said[0]] and said[0].startswith("collectives: world_size=2, 12 sequence-parallel rows")
    assert ("the engine said: sequence-parallel steps from 64 rows: plain gloo reduce-scatter / all-gather"
            in said[0])
    meta = {"gpu": "cpu", "device": "cpu", "dtype": "float32", "kernels": "collectives", "versions": "-",
            "date": "-", "grid": json.dumps(grid.as_dict(), separators=(",", ":"))}
    path = write_operator_file(tmp_path / "cpu-float32-collectives-n2.csv", meta, rows)
    profile = OperatorProfile.load([path])
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        assert 0 < profile.grid(op, 2)(96, 64, 64) < 1.0
        assert 0 < profile.grid(op, 2)(128, 128, 128) < 1.0  # over the FLOP cap: filled as gemm's


def test_the_boundary_pass_runs_only_with_cells_the_world_size_divides_and_a_failed_one_is_said(monkeypatch):
    """collective_rows: no cells (a grid without sequence_parallel_m), no boundary pass; cells no m
    of which splits over the world size, none either, and the log says why; a failed pass leaves
    the other rows and the log says why."""
    from experiments.lib.profiling.sequence_parallel_rows import sequence_parallel_worker

    gathered = {"op": "all_gather", "bytes": 1024, "world_size": 2, "time_s": 1e-5}
    boundary = {"op": "all_gather_matmul", "m": 64, "k": 32, "n": 32, "world_size": 2, "time_s": 2e-5}
    outcomes, calls = [], []

    def fake_run_ranks(target, world, args, timeout_s):
        calls.append((target, args))
        return outcomes.pop(0)

    monkeypatch.setattr(collectives, "run_ranks", fake_run_ranks)
    said: list[str] = []
    outcomes[:] = [("ok", ([gathered], "said"))]
    assert collectives.collective_rows([2], SIZES, torch.float32, False, said.append) == [gathered]
    assert [t for t, _ in calls] == [collectives._worker] and not outcomes
    outcomes[:] = [("ok", ([gathered], "said")), ("ok", ([boundary], "the engine's line", "fused"))]
    implementations: dict[str, str] = {}
    rows = collectives.collective_rows([2], SIZES, torch.float32, False, said.append,
                                       cells=[(64, 32, 32), (3, 32, 32)], implementations=implementations)
    assert rows == [gathered, boundary] and calls[-1][0] is sequence_parallel_worker
    assert implementations == {"2": "fused"}
    assert calls[-1][1][0] == [(64, 32, 32)]  # only the cells whose m splits over 2 ranks
    assert said[-1].endswith("the engine said: the engine's line")
    outcomes[:] = [("ok", ([gathered], "said"))]
    rows = collectives.collective_rows([2], SIZES, torch.float32, False, said.append, cells=[(3, 32, 32)])
    assert rows == [gathered]
    assert said[-1] == ("collectives: world_size=2, no sequence-parallel rows: no m of sequence_parallel_m "
                        "splits into 2 equal parts")
    outcomes[:] = [("ok", ([gathered], "said")), ("error", "rank 1: it hung")]
    implementations = {}
    rows = collectives.collective_rows([2], SIZES, torch.float32, False, said.append, cells=[(64, 32, 32)],
                                       implementations=implementations)
    assert rows == [gathered] and implementations == {}
    assert said[-1] == ("collectives: world_size=2, no sequence-parallel rows (their pass failed): "
                        "rank 1: it hung")


def test_each_boundary_row_is_the_fastest_of_passes_in_opposite_orders(monkeypatch):
    """The cells are timed ascending, then descending, and each row keeps its faster time: an
    order effect (the first cells timed slow) does not stay in the profile."""
    from types import SimpleNamespace

    import experiments.lib.profiling.sequence_parallel_rows as spr

    cells = [(64, 32, 32), (128, 32, 32), (256, 32, 32)]
    timed: list[tuple[str, tuple[int, int, int]]] = []
    monkeypatch.setattr(spr, "boundary_call", lambda group, op, cell, dtype, device: (op, cell))
    monkeypatch.setattr(spr, "fastest_s", lambda seconds, group, device: seconds)

    times = iter([5.0, 6.0, 1.0, 2.0, 9.0, 8.0, 1.5, 2.5, 7.0, 7.5, 3.0, 4.0])  # some cells faster first, some later
    seen: dict[tuple[str, tuple[int, int, int]], list[float]] = {}

    def mean_call_s(call, iters, mode):
        timed.append(call)
        seen.setdefault(call, []).append(next(times))
        return seen[call][-1]

    monkeypatch.setattr(spr, "mean_call_s", mean_call_s)
    group = SimpleNamespace(size=2)
    rows = spr.boundary_rows(group, cells, torch.float32, torch.device("cpu"), 2, passes=2)
    order = [cell for _, cell in timed[::2]]
    assert order == cells + cells[::-1]
    assert [(r["op"], (r["m"], r["k"], r["n"])) for r in rows] == [(op, c) for c in cells for op in spr.BOUNDARY_OPS]
    assert [r["time_s"] for r in rows] == [min(seen[op, c]) for c in cells for op in spr.BOUNDARY_OPS]
    assert [r["time_s"] for r in rows] != [seen[op, c][-1] for c in cells for op in spr.BOUNDARY_OPS]
    with pytest.raises(ValueError, match="passes=0 is invalid"):
        spr.boundary_rows(group, cells, torch.float32, torch.device("cpu"), 2, passes=0)
