"""The collectives profiler's rank worker on the CPU (experiments/lib/profiling/collectives.py): the
ops it times through the engine's group, with the engine's symmetric-memory paths played by a
stand-in for torch's `symm_mem` ops (and the fused boundary by the Triton kernel in the
interpreter, its peers mirrored), and the NCCL-only rows with the engine's reason when the group
has no symmetric paths."""
from __future__ import annotations

import queue

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
    assert by_op == {op: SIZES for op in ("all_reduce", "all_gather", "all_reduce_one_shot", "all_reduce_two_shot")}
    assert all(r["time_s"] > 0 and r["world_size"] == 1 for r in rows)
    assert buffers[0].numel() == max(SIZES)  # the buffer holds the largest message timed on it
    # Each symmetric op ran its own path, on messages staged in the symmetric buffer.
    paths = {path for path, _ in ops.calls}
    assert paths == {ONE_SHOT, TWO_SHOT}
    assert {ptr for _, ptr in ops.calls} == {buffers[0].data_ptr()}


def test_without_symmetric_memory_the_rows_are_nccls_and_the_engine_says_why():
    rows, said = _run_worker(SIZES, torch.float32)
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather"}
    assert said == "all-reduce: NCCL/gloo for every message (custom all-reduce off: one rank: nothing to reduce)"


def test_a_dtype_the_kernels_do_not_take_gets_no_symmetric_rows():
    assert collectives.symmetric_sizes(SIZES, torch.float16, 2) == []
    assert collectives.symmetric_sizes(SIZES, torch.bfloat16, 2) == SIZES
    assert collectives.symmetric_sizes([2, 1024, 2**31], torch.bfloat16, 1) == [1024]  # whole 4-byte vectors, the limit
    rows, said = _run_worker(SIZES, torch.float16)
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather"}
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
                     for op in ("all_reduce", "all_gather", "all_reduce_one_shot", "all_reduce_two_shot")}
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
