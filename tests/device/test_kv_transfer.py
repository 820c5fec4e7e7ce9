"""The KV link between a prefill and a decode process on CPU (gloo): every layer's K and V of the
sent blocks land in the receiver's blocks (other blocks untouched), several transfers in flight
match in order, and a peer that dies or never answers fails the transfers within the bound."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from engine.disagg.kv_transfer import RECV_RANK, SEND_RANK, KVLink, KVTransferError, join_store, open_store

LAYERS, BLOCKS, SHAPE = 3, 10, (4, 2, 8)  # block_size 4, 2 KV heads, head_dim 8
TIMEOUT_S = 3.0


def _caches(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(BLOCKS, *SHAPE, generator=g) for _ in range(LAYERS)]
    v = [torch.randn(BLOCKS, *SHAPE, generator=g) for _ in range(LAYERS)]
    return k, v


def _receiver(port: int, plan: list[list[int]], result, mode: str) -> None:
    """The decode side: receive each plan's blocks and report the caches (or die, or hang)."""
    link = KVLink(RECV_RANK, join_store(port, 10.0), "cpu", TIMEOUT_S)
    k, v = [torch.zeros(BLOCKS, *SHAPE) for _ in range(LAYERS)], [torch.zeros(BLOCKS, *SHAPE) for _ in range(LAYERS)]
    if mode == "die":
        os._exit(3)
    if mode == "hang":
        time.sleep(60)
    transfers = [link.recv(f"r{i}", k, blocks) for i, blocks in enumerate(plan)]
    done = link.wait_all(10.0)
    assert [t.key for t in done] == [t.key for t in transfers] and all(t.error is None for t in done)
    for t in done:
        link.scatter(t, k, v)
    result.put(([x.clone() for x in k], [x.clone() for x in v]))
    link.close()


def _start(plan, mode: str = "ok"):
    ctx = multiprocessing.get_context("spawn")
    store = open_store(10.0)
    result = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(store.port, plan, result, mode), daemon=True)
    proc.start()
    return store, proc, result


def test_blocks_of_every_layer_land_in_the_allocated_blocks():
    sent = [[3, 1, 7], [0], [9, 8]]
    received = [[0, 2, 4], [5], [6, 9]]  # the receiver's own allocation
    store, proc, result = _start(received)
    link = KVLink(SEND_RANK, store, "cpu", TIMEOUT_S)
    k, v = _caches(0)
    transfers = [link.send(f"r{i}", k, v, blocks) for i, blocks in enumerate(sent)]
    assert transfers[0].num_bytes == 2 * LAYERS * 3 * 4 * 2 * 8 * 4
    done = link.wait_all(10.0)
    assert [t.error for t in done] == [None] * 3 and all(t.seconds >= 0 for t in done)
    rk, rv = result.get(timeout=20)
    proc.join(10)
    link.close()
    untouched = set(range(BLOCKS)) - {b for blocks in received for b in blocks}
    for layer in range(LAYERS):
        for src, dst in zip(sent, received):
            assert torch.equal(rk[layer][dst], k[layer][src]) and torch.equal(rv[layer][dst], v[layer][src])
        for b in untouched:
            assert not rk[layer][b].any() and not rv[layer][b].any()


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_dead_or_silent_peer_fails_the_transfer_within_the_bound(mode):
    store, proc, _ = _start([[0]], mode)
    link = KVLink(SEND_RANK, store, "cpu", TIMEOUT_S)
    k, v = _caches(1)
    t0 = time.monotonic()
    try:
        transfers = [link.send("a", k, v, [1, 2]), link.send("b", k, v, [3])]
    except KVTransferError:  # the peer's connection was already gone when posting
        transfers = []
    done = link.wait_all(TIMEOUT_S + 5.0)
    assert time.monotonic() - t0 < TIMEOUT_S + 5.0
    assert len(done) == len(transfers) and all(isinstance(t.error, KVTransferError) for t in done)
    assert link.failure is not None
    with pytest.raises(KVTransferError):
        link.send("c", k, v, [4])
    link.close()
    proc.kill()
    proc.join(5)


def test_bad_block_ids_and_wrong_side_are_refused():
    store, proc, _ = _start([], "ok")
    link = KVLink(SEND_RANK, store, "cpu", TIMEOUT_S)
    k, v = _caches(2)
    with pytest.raises(ValueError, match=r"block ids \[10\] are out of range"):
        link.send("a", k, v, [10])
    with pytest.raises(ValueError, match="block_ids is empty"):
        link.send("a", k, v, [])
    with pytest.raises(RuntimeError, match="cannot receive"):
        link.recv("a", k, [0])
    with pytest.raises(ValueError, match="rank=2 is invalid"):
        KVLink(2, store, "cpu", TIMEOUT_S)
    link.close()
    proc.join(10)
