"""The KV link between a prefill and a decode process on CPU (gloo): every layer's K and V of the
sent blocks land in the receiver's blocks (other blocks untouched), several requests moved in one
transfer land in their own blocks, several transfers in flight match in order, a send returns
before its receive is even posted (a sender's loop is never held by a send in flight), a peer
that dies or never answers fails the transfers within the bound, and the start-up transfer moves
one block through that path leaving both ends' caches as they were."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from engine.disagg.kv_transfer import RECV_RANK, SEND_RANK, KVLink, join_store, open_store
from engine.disagg.kv_transfer_message import KVTransferError
from engine.disagg.link_warmup import warm_recv, warm_send

LAYERS, BLOCKS, SHAPE = 3, 10, (4, 2, 8)  # block_size 4, 2 KV heads, head_dim 8
TIMEOUT_S = 3.0


def _caches(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(BLOCKS, *SHAPE, generator=g) for _ in range(LAYERS)]
    v = [torch.randn(BLOCKS, *SHAPE, generator=g) for _ in range(LAYERS)]
    return k, v


def _receiver(port: int, plan: list[list[tuple[str, list[int]]]], result, mode: str, go=None) -> None:
    """The decode side: receive each planned transfer's parts and report the caches (or die, or
    hang; with `go`, post the receives only once it is set)."""
    link = KVLink(RECV_RANK, join_store(port, 10.0), "cpu", TIMEOUT_S)
    k, v = [torch.zeros(BLOCKS, *SHAPE) for _ in range(LAYERS)], [torch.zeros(BLOCKS, *SHAPE) for _ in range(LAYERS)]
    if mode == "die":
        os._exit(3)
    if mode == "hang":
        time.sleep(60)
    if go is not None:
        assert go.wait(20.0)
    transfers = [link.recv(parts, k) for parts in plan]
    done = link.wait_all(10.0)
    assert [t.keys for t in done] == [t.keys for t in transfers] and all(t.error is None for t in done)
    for t in done:
        link.scatter(t, k, v)
    result.put(([x.numpy().copy() for x in k], [x.numpy().copy() for x in v]))  # by value: this process may end first
    link.close()


def _warm_receiver(port: int, result) -> None:
    """The decode side's start-up transfer, then one real transfer: its caches before and after the
    start-up transfer, what it reported, and how many messages its end posted."""
    link = KVLink(RECV_RANK, join_store(port, 10.0), "cpu", TIMEOUT_S)
    k, v = _caches(7)
    before = ([x.numpy().copy() for x in k], [x.numpy().copy() for x in v])  # by value: this process may end first
    warm = warm_recv(link, k, v)
    after = ([x.numpy().copy() for x in k], [x.numpy().copy() for x in v])
    transfer = link.recv([("a", [3])], k)
    assert link.wait_all(10.0) == [transfer] and transfer.error is None
    result.put((before, after, warm, link.num_posted))
    link.close()


def _start(plan, mode: str = "ok", go=None, target=None):
    ctx = multiprocessing.get_context("spawn")
    store = open_store(10.0)
    result = ctx.Queue()
    args = (store.port, result) if target is not None else (store.port, plan, result, mode, go)
    proc = ctx.Process(target=target or _receiver, args=args, daemon=True)
    proc.start()
    return store, proc, result


def _assert_landed(rk, rv, k, v, sent: list[list[int]], received: list[list[int]]) -> None:
    rk, rv = [torch.from_numpy(x) for x in rk], [torch.from_numpy(x) for x in rv]
    untouched = set(range(BLOCKS)) - {b for blocks in received for b in blocks}
    for layer in range(LAYERS):
        for src, dst in zip(sent, received):
            assert torch.equal(rk[layer][dst], k[layer][src]) and torch.equal(rv[layer][dst], v[layer][src])
        for b in untouched:
            assert not rk[layer][b].any() and not rv[layer][b].any()


def test_blocks_of_every_layer_land_in_the_allocated_blocks():
    sent = [[3, 1, 7], [0], [9, 8]]
    received = [[0, 2, 4], [5], [6, 9]]  # the receiver's own allocation
    store, proc, result = _start([[(f"r{i}", blocks)] for i, blocks in enumerate(received)])
    link = KVLink(SEND_RANK, store, "cpu", TIMEOUT_S)
    k, v = _caches(0)
    transfers = [link.send([(f"r{i}", blocks)], k, v) for i, blocks in enumerate(sent)]
    assert transfers[0].num_bytes == 2 * LAYERS * 3 * 4 * 2 * 8 * 4
    done = link.wait_all(10.0)
    assert [t.error for t in done] == [None] * 3 and all(t.seconds >= 0 for t in done)
    rk, rv = result.get(timeout=20)
    proc.join(10)
    link.close()
    _assert_landed(rk, rv, k, v, sent, received)


def test_several_requests_in_one_transfer_land_in_their_own_blocks():
    """One message carries three requests' blocks (a prefill step's hand-offs), a second carries
    one: each request's blocks land in the blocks the receiver allocated for it."""
    sent = {"a": [3, 1], "b": [0], "c": [9, 8, 4], "d": [2]}
    received = {"a": [7, 0], "b": [5], "c": [6, 9, 1], "d": [3]}
    plan = [[(key, received[key]) for key in "abc"], [("d", received["d"])]]
    store, proc, result = _start(plan)
    link = KVLink(SEND_RANK, store, "cpu", TIMEOUT_S)
    k, v = _caches(4)
    first = link.send([(key, sent[key]) for key in "abc"], k, v)
    link.send([("d", sent["d"])], k, v)
    assert first.keys == ["a", "b", "c"] and first.block_ids == [3, 1, 0, 9, 8, 4]
    assert first.num_bytes == 2 * LAYERS * 6 * 4 * 2 * 8 * 4
    done = link.wait_all(10.0)
    assert [t.keys for t in done] == [["a", "b", "c"], ["d"]] and all(t.error is None for t in done)
    rk, rv = result.get(timeout=20)
    proc.join(10)
    link.close()
    _assert_landed(rk, rv, k, v, list(sent.values()), list(received.values()))


def test_a_send_returns_before_its_receive_is_posted():
    """The sender's loop is not held by a send in flight: `send` returns (the transfer not done)
    while the receiver has not even posted its receive; the transfer completes once it has."""
    go = multiprocessing.get_context("spawn").Event()
    store, proc, result = _start([[("a", [4, 5])]], go=go)
    link = KVLink(SEND_RANK, store, "cpu", TIMEOUT_S)
    k, v = _caches(5)
    transfer = link.send([("a", [0, 1])], k, v)
    assert not transfer.done.is_set() and link.num_in_flight == 1
    go.set()
    done = link.wait_all(10.0)
    assert done == [transfer] and transfer.error is None
    rk, rv = result.get(timeout=20)
    proc.join(10)
    link.close()
    _assert_landed(rk, rv, k, v, [[0, 1]], [[4, 5]])


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_dead_or_silent_peer_fails_the_transfer_within_the_bound(mode):
    store, proc, _ = _start([[("a", [0])]], mode)
    link = KVLink(SEND_RANK, store, "cpu", TIMEOUT_S)
    k, v = _caches(1)
    t0 = time.monotonic()
    try:
        transfers = [link.send([("a", [1, 2])], k, v), link.send([("b", [3])], k, v)]
    except KVTransferError:  # the peer's connection was already gone when posting
        transfers = []
    done = link.wait_all(TIMEOUT_S + 5.0)
    assert time.monotonic() - t0 < TIMEOUT_S + 5.0
    assert len(done) == len(transfers) and all(isinstance(t.error, KVTransferError) for t in done)
    assert link.failure is not None
    with pytest.raises(KVTransferError):
        link.send([("c", [4])], k, v)
    link.close()
    proc.kill()
    proc.join(5)


def test_the_start_up_transfer_moves_one_block_and_leaves_both_caches_as_they_were():
    """Each end posts one message through the serving path before any request's (the link's first
    use is not a request's), the receiver's block is written back, the sender's only read."""
    store, proc, result = _start([], target=_warm_receiver)
    link = KVLink(SEND_RANK, store, "cpu", TIMEOUT_S)
    k, v = _caches(1)
    before = ([x.clone() for x in k], [x.clone() for x in v])
    warm = warm_send(link, k, v)
    assert link.num_posted == 1 and warm.seconds > 0
    assert warm.num_bytes == 2 * LAYERS * k[0][0].numel() * k[0].element_size()  # one block of each K and V
    link.send([("a", [2])], k, v)
    assert link.wait_all(10.0)[0].error is None and link.num_posted == 2
    (rk0, rv0), (rk1, rv1), peer_warm, peer_posted = result.get(timeout=20)
    proc.join(10)
    link.close()
    assert peer_warm.num_bytes == warm.num_bytes and peer_posted == 2
    assert all((a == b).all() for a, b in zip(rk0 + rv0, rk1 + rv1))
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], k + v))


def test_bad_block_ids_and_wrong_side_are_refused():
    store, proc, _ = _start([], "ok")
    link = KVLink(SEND_RANK, store, "cpu", TIMEOUT_S)
    k, v = _caches(2)
    with pytest.raises(ValueError, match=r"block ids \[10\] are out of range"):
        link.send([("a", [10])], k, v)
    with pytest.raises(ValueError, match="at least one block"):
        link.send([("a", [])], k, v)
    with pytest.raises(ValueError, match="moves each block once"):
        link.send([("a", [1]), ("b", [1])], k, v)
    with pytest.raises(RuntimeError, match="cannot receive"):
        link.recv([("a", [0])], k)
    with pytest.raises(ValueError, match="rank=2 is invalid"):
        KVLink(2, store, "cpu", TIMEOUT_S)
    link.close()
    proc.join(10)
