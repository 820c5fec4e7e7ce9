"""Shared by the tests of the symmetric-memory all-reduce (engine/distributed/custom_all_reduce.py,
symmetric_all_reduce.py, kernels/all_reduce.py) and of what times it
(experiments/lib/profiling/collectives.py): a stand-in for torch's `symm_mem` ops, a mirrored peer
table for the Triton kernels and one for the Lamport kernel, counted CUDA events for the pacing, and the bounded two-process run
of the GPU tests."""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable

from engine.distributed.all_reduce_path import ONE_SHOT, TWO_SHOT


class FakeSymmOps:
    """torch.ops.symm_mem's two ops as two ranks holding the same input would see them (sum = 2x);
    records which op ran on which buffer address."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def one_shot_all_reduce_out(self, staged, op, group, out):
        self.calls.append((ONE_SHOT, staged.data_ptr()))
        return out.copy_(staged * 2)

    def two_shot_all_reduce_out(self, staged, op, group, out):
        self.calls.append((TWO_SHOT, staged.data_ptr()))
        return out.copy_(staged * 2)


def mirrored_peers(buffer, world: int = 2, programs: int = 3):
    """The Triton kernels' peer table for `world` ranks that all hold this rank's buffer (so the sum
    is `world` x the message, as `FakeSymmOps` has it), barriers compiled out for the interpreter;
    one-shot only: two-shot's in-place slice sums would be read back by the mirrored ranks."""
    import torch

    from kernels.all_reduce import PeerBuffers

    pads = torch.zeros(world * programs, dtype=torch.int32)
    peers = PeerBuffers((buffer.data_ptr(),) * world, (pads.data_ptr(),) * world, 0, buffer.numel(), programs,
                        barrier=False)
    return peers, pads  # keep the pads alive as long as the peers


def mirrored_lamport(buffer, slot_bytes: int):
    """The Lamport all-reduce of rank 0 of 2 over stand-ins, `buffer` its barrier kernels' region
    (`mirrored_peers`): rank 1 holds the same values as rank 0, so rank 1's area is placed one slot
    after rank 0's, where rank 0's push into rank 1's slot 0 of a round lands on rank 0's own slot
    1 of that round: the push rank 0 polls for arrives as rank 1's (the sum is 2x the message, as
    `FakeSymmOps` has it). Returns the `LamportAllReduce` and what must outlive it."""
    import torch

    from engine.distributed.lamport_all_reduce import LamportAllReduce
    from kernels.all_reduce_lamport import LamportSlots

    area_bytes = LamportSlots.area_bytes(2, slot_bytes)
    memory = torch.zeros(area_bytes + slot_bytes, dtype=torch.uint8)  # rank 1's area reaches one slot further
    slots = LamportSlots((memory.data_ptr(), memory.data_ptr() + slot_bytes), 0, slot_bytes)
    peers, pads = mirrored_peers(buffer)
    custom = LamportAllReduce(buffer, memory[:area_bytes], slots, "g", slot_bytes, slot_bytes, ops=FakeSymmOps(),
                              peers=peers)
    return custom, (memory, pads)


def counting_events(monkeypatch, capturing: bool = False) -> type:
    """torch.cuda.Event as numbered stand-ins (`n`: 1, 2, ... in order made; `made`: how many), and
    whether a graph capture is under way."""
    import torch

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1
            self.n = Event.made

        def record(self):
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    return Event


def two_rank_reports(target: Callable, deadline_s: float, world: int = 2) -> dict[int, list[str]]:
    """Spawn `target(rank, port, results)` on ranks 0 and 1 (0 .. world - 1; meeting at a store
    opened here); each puts `(rank, problems, *what_it_reached)`. Returns every rank's problems;
    fails the test naming the ranks that sent nothing within `deadline_s` (a hung barrier or
    collective). Every process is joined or killed before it returns."""
    import pytest

    from engine.distributed.parallel_state import open_store

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = open_store(world, deadline_s)
    procs = [ctx.Process(target=target, args=(r, store.port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, list[str]] = {}
    try:
        for _ in range(world):
            try:
                rank, problems, *reached = results.get(timeout=deadline_s)
            except Exception:  # noqa: BLE001 (queue.Empty)
                pytest.fail(f"no report within {deadline_s:.0f}s from ranks {sorted(set(range(world)) - set(reports))} "
                            f"(exit codes {[p.exitcode for p in procs]}): a hung barrier or collective")
            reports[rank] = problems
            print(f"\n[two ranks] rank {rank}: {len(problems)} problems" + (f", last step: {reached}" if reached else ""))
    finally:
        for p in procs:
            p.join(15.0)
            if p.is_alive():
                p.kill()
    return reports
