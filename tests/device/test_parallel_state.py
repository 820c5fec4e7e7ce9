"""The tensor-parallel group's names: torch restarts its group counter when a group ends but keeps
per-name state for the process's life (symmetric memory's group record and rendezvous count), so
each engine's groups take names that no earlier group of rank 0's process had, and the workers
(fresh processes) take the same ones."""
from __future__ import annotations

import multiprocessing

import torch
import torch.distributed as dist

from engine.distributed import parallel_state
from engine.distributed.parallel_state import (
    end_group,
    group_number_from_rank0,
    init_group,
    join_store,
    open_store,
)


def test_engines_one_after_another_in_a_process_name_their_groups_afresh():
    names = []
    for _ in range(3):
        init_group(open_store(1, 10), 0, 1, torch.device("cpu"), 10)
        names.append(dist.group.WORLD.group_name)
        assert end_group(4.0, 2.0)
    assert len(set(names)) == 3, names


def test_workers_read_rank0s_first_group_number_from_the_store(monkeypatch):
    monkeypatch.setattr(parallel_state, "_next_group_number", 7)
    store = dist.HashStore()
    assert group_number_from_rank0(store, 0) == 7
    monkeypatch.setattr(parallel_state, "_next_group_number", 0)  # a fresh worker's own count
    assert group_number_from_rank0(store, 1) == 7


def _worker(port: int, names) -> None:
    init_group(join_store(port, 2, 30), 1, 2, torch.device("cpu"), 30)
    names.put(dist.group.WORLD.group_name)
    end_group(4.0, 2.0)


def test_a_fresh_worker_names_its_group_as_rank0_does_after_earlier_engines():
    init_group(open_store(1, 10), 0, 1, torch.device("cpu"), 10)  # an earlier engine in this process
    assert end_group(4.0, 2.0)
    ctx = multiprocessing.get_context("spawn")
    names = ctx.Queue()
    store = open_store(2, 30)
    worker = ctx.Process(target=_worker, args=(store.port, names), daemon=True)
    worker.start()
    try:
        init_group(store, 0, 2, torch.device("cpu"), 30)
        mine = dist.group.WORLD.group_name
        assert names.get(timeout=30) == mine != "0"
    finally:
        end_group(4.0, 2.0)
        worker.join(15)
        if worker.is_alive():
            worker.kill()
