"""KV blocks moved between a prefill engine process and a decode engine process.

`KVLink` is one end of a two-rank point-to-point link (rank 0: the prefill side, which sends; rank
1: the decode side, which receives) over torch.distributed's own backends: NCCL on GPUs (device
to device, over NVLink within a host), gloo on CPUs. The link is a backend object built on a
`TCPStore` (`ProcessGroupNCCL` / `ProcessGroupGloo` constructed directly, as vLLM's stateless
groups are), not torch.distributed's default group, so either engine may also be tensor-parallel
in its own process group and a process may hold several links.

A transfer moves every layer's K and V of one or more requests' blocks (its `parts`: request id
and block ids, in order) as one message: the sender gathers the blocks into one contiguous staging
buffer `[2 x layers, blocks, block_size, kv_heads, head_dim]` (K of layer l at 2l, V at 2l + 1) in
one launch (`kernels.gather_blocks`) and sends it; the receiver receives into a staging buffer of
the same shape and scatters it into the blocks its block manager allocated before the send in one
launch (`kernels.scatter_blocks`; it tells the sender to send only then, so a send never waits for
an allocation). A transfer's fixed cost (launches, the send/recv call, noticing completion) is paid
once per message, so the engine pair moves every hand-off reserved together in one.
`experiments/bench_kv_transfer.py` measures that cost, one message per layer and the link's copy
bandwidth.
The message itself (its parts, the staging layout, a `Transfer` in flight) is
engine/disagg/kv_transfer_message.py; this module moves it.

Overlap: on a GPU the gather runs on the link's side stream after the compute stream's work so
far (the prefill step that wrote the blocks), and NCCL runs the send on its own stream after it;
the compute stream never waits for the link, so the next prefill runs while the blocks move. The
receiver's scatter runs on its compute stream once the receive is complete.

Bounds: every transfer completes within `timeout_s` of the link's last progress (the previous
transfer's end, or its own start), else the link fails: the transfer and every one queued behind
it end with `KVTransferError`, and so does every later call. A peer that dies is seen by gloo at
once (its connection closes) and on NCCL by the deadline; the link's NCCL communicator is then
aborted, so no kernel is left waiting on the dead peer. Completion is waited for on one helper
thread per link, in posting order (the order the two sides match their messages in).
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import os
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

import kernels
from engine.disagg.kv_transfer_message import (
    KVTransferError,
    Transfer,
    checked_parts,
    interleaved,
    staging_shape,
)
from engine.distributed.parallel_state import bounded

SEND_RANK, RECV_RANK = 0, 1
# An NCCL transfer's completion is checked after _POLL_S, then at doubling intervals up to
# _POLL_MAX_S: a short transfer is seen within ~0.1 ms, a long one wakes the helper (and asks the
# engine loop's thread for the GIL) at most every millisecond.
_POLL_S, _POLL_MAX_S = 0.0001, 0.001
_TEARDOWN_S = 4.0  # an NCCL abort or shutdown is waited for this long (on a helper thread)


def open_store(timeout_s: float) -> dist.TCPStore:
    """The prefill side's rendezvous store on a free port of 127.0.0.1 (its `.port` goes to the peer)."""
    return dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class KVLink:
    """One end of the link. `rank`: SEND_RANK (prefill) or RECV_RANK (decode); `store`: the pair's
    rendezvous (`open_store` on the prefill side, `join_store` with its port on the decode side);
    `device`: where the KV cache lives (cuda: NCCL, cpu: gloo); `timeout_s`: the progress bound."""

    def __init__(self, rank: int, store: dist.Store, device: torch.device | str, timeout_s: float,
                 name: str = "kv") -> None:
        if rank not in (SEND_RANK, RECV_RANK):
            raise ValueError(f"rank={rank} is invalid: {SEND_RANK} (prefill, sends) or {RECV_RANK} (decode, receives)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} is invalid: must be > 0")
        self.rank, self.peer = rank, 1 - rank
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        prefixed = dist.PrefixStore(name, store)
        # The backend's own deadline is longer than the link's, so the link reports a hang itself.
        backend_timeout = datetime.timedelta(seconds=timeout_s + 30.0)
        if self.device.type == "cuda":
            # A timed-out or aborted NCCL operation raises instead of ending the process.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = backend_timeout
            self.backend = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
            self.stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device)
        else:
            self.backend = dist.ProcessGroupGloo(prefixed, rank, 2, backend_timeout)
            self.stream = None
        sequence = getattr(self.backend, "_set_sequence_number_for_group", None)
        if sequence is not None:  # as torch's own groups are set up (both ends, at once)
            sequence()
        self._handshake(timeout_s)
        self._queue: collections.deque[Transfer] = collections.deque()  # posted, completion not yet seen
        self._finished: collections.deque[Transfer] = collections.deque()  # done or failed, not yet polled
        self._lock = threading.Condition()
        self._failure: KVTransferError | None = None
        self._closed = False
        self.num_posted = 0  # messages posted on this end (the start-up transfer's included)
        self._waiter = threading.Thread(target=self._wait_loop, name=f"kv-link-{rank}", daemon=True)
        self._waiter.start()

    def _handshake(self, timeout_s: float) -> None:
        """One small message each way's first use, so NCCL sets its communicator up now (both ends
        are here), not inside the first transfer (whose receiver would block in the set-up until the
        sender posts). On a helper thread, waited for `timeout_s`: a set-up that hangs raises."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                if self.device.type == "cuda":  # a new thread starts on device 0
                    torch.cuda.set_device(self.device)
                probe = torch.zeros(1, device=self.device)
                op = self.backend.send if self.rank == SEND_RANK else self.backend.recv
                work = op([probe], self.peer, 0)
                if self.device.type == "cuda":
                    work.wait()
                    torch.cuda.synchronize(self.device)
                else:
                    work.wait(datetime.timedelta(seconds=timeout_s))
            except BaseException as e:  # noqa: BLE001 (raised below, in the constructor's thread)
                errors.append(e)

        helper = threading.Thread(target=run, name=f"kv-link-handshake-{self.rank}", daemon=True)
        helper.start()
        helper.join(timeout_s)
        if helper.is_alive() or errors:
            why = f"({str(errors[0]).splitlines()[0][:200]})" if errors else f"within timeout_s={timeout_s}"
            raise KVTransferError(f"the KV link's peer did not answer its first message {why}")

    # ---- posting -----------------------------------------------------------------------------
    def send(self, parts: Sequence[tuple[str, list[int]]], k_caches: Sequence[torch.Tensor],
             v_caches: Sequence[torch.Tensor], after_compute: bool = True) -> Transfer:
        """Gather the blocks of every (request id, block ids) part, every layer, into one staging
        buffer in one launch and send it as one message (prefill side). On a GPU both run on the
        link's side stream after the compute stream's work so far (`after_compute`), or at once
        (False: the caller knows the blocks' writes are done, their step's tokens were read back,
        and the compute stream may be running a later step that the gather need not wait for):
        nothing here waits for the GPU."""
        parts = self._check(SEND_RANK, parts, k_caches)
        block_ids = [b for _, blocks in parts for b in blocks]
        if self.stream is not None and after_compute:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the blocks' writes are done
        with _on(self.stream):
            staging = torch.empty(staging_shape(k_caches, len(block_ids)), dtype=k_caches[0].dtype,
                                  device=self.device)
            kernels.gather_blocks(interleaved(k_caches, v_caches), self._index(block_ids), staging)
            return self._post(parts, staging, lambda: self.backend.send([staging], self.peer, 0))

    def recv(self, parts: Sequence[tuple[str, list[int]]], k_caches: Sequence[torch.Tensor]) -> Transfer:
        """Post the receive of the parts' staging buffer (decode side; the sender's parts have the
        same block counts in the same order); `scatter` puts it into the blocks once `poll`
        returns it done."""
        parts = self._check(RECV_RANK, parts, k_caches)
        num_blocks = sum(len(blocks) for _, blocks in parts)
        with _on(self.stream):
            staging = torch.empty(staging_shape(k_caches, num_blocks), dtype=k_caches[0].dtype, device=self.device)
            return self._post(parts, staging, lambda: self.backend.recv([staging], self.peer, 0))

    def scatter(self, transfer: Transfer, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        """Write a completed receive into its blocks in one launch (on the compute stream; decode side)."""
        if transfer.error is not None or not transfer.done.is_set():
            raise KVTransferError(f"requests {transfer.keys}: their KV transfer did not complete")
        if self.device.type == "cuda":  # the compute stream after the receive (complete already)
            transfer.work.wait()
            # The staging buffer is the side stream's memory: not reused before the scatter has read it.
            transfer.staging.record_stream(torch.cuda.current_stream(self.device))
        kernels.scatter_blocks(transfer.staging, interleaved(k_caches, v_caches), self._index(transfer.block_ids))

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        """The block ids on the device without a host sync: from pinned memory (reused by torch's
        host allocator only once the copy is done), copied on the current stream."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        if self.device.type != "cuda":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _check(self, rank: int, parts: Sequence[tuple[str, list[int]]],
               k_caches: Sequence[torch.Tensor]) -> list[tuple[str, list[int]]]:
        if self.rank != rank:
            side = "send" if rank == SEND_RANK else "receive"
            raise RuntimeError(f"this end of the link is rank {self.rank}: it cannot {side}")
        return checked_parts(parts, k_caches[0].shape[0])

    def _post(self, parts: list[tuple[str, list[int]]], staging: torch.Tensor, op) -> Transfer:
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise KVTransferError("the KV link is closed")
            try:
                work = op()
            except RuntimeError as e:  # the peer's connection is gone
                self._fail_locked(KVTransferError(f"the KV link's peer failed: {e}"))
                raise self._failure from e
            transfer = Transfer(parts, staging, work, time.monotonic())
            self.num_posted += 1
            self._queue.append(transfer)
            self._lock.notify_all()
            return transfer

    # ---- completion --------------------------------------------------------------------------
    def poll(self) -> list[Transfer]:
        """The transfers that ended since the last poll, in posting order (`error` set if failed)."""
        with self._lock:
            ended = list(self._finished)
            self._finished.clear()
            return ended

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._queue)

    @property
    def failure(self) -> KVTransferError | None:
        return self._failure

    def wait_all(self, timeout_s: float) -> list[Transfer]:
        """Wait (at most `timeout_s`) until nothing is in flight; then `poll()`."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queue and self._failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
        return self.poll()

    def _wait_loop(self) -> None:
        last_progress = time.monotonic()
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed and not self._queue:
                    return
                transfer = self._queue[0]
            deadline = max(last_progress, transfer.posted_at) + self.timeout_s
            error = self._wait_one(transfer, deadline)
            with self._lock:
                if self._queue and self._queue[0] is transfer:
                    self._queue.popleft()
                    if error is None:
                        transfer.finished_at = last_progress = time.monotonic()
                        self._finished.append(transfer)
                        transfer.done.set()
                    else:
                        self._queue.appendleft(transfer)
                        self._fail_locked(error)
                self._lock.notify_all()

    def _wait_one(self, transfer: Transfer, deadline: float) -> KVTransferError | None:
        what = f"requests {transfer.keys}: KV transfer of {len(transfer.block_ids)} blocks"
        try:
            if self.device.type == "cuda":
                pause = _POLL_S
                while not transfer.work.is_completed():
                    if time.monotonic() > deadline or self._failure is not None:
                        return KVTransferError(f"{what} made no progress within timeout_s={self.timeout_s} "
                                               "(the peer died or hung)")
                    time.sleep(pause)
                    pause = min(2 * pause, _POLL_MAX_S)
            else:  # gloo: a bounded wait (a dead peer's closed connection raises at once)
                left = max(0.001, deadline - time.monotonic())
                transfer.work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as e:
            return KVTransferError(f"{what} failed: the peer died or hung ({str(e).splitlines()[0][:200]})")
        return None

    def _fail_locked(self, error: KVTransferError) -> None:
        """Fail the link: every queued transfer ends with `error`, the backend is aborted."""
        if self._failure is None:
            self._failure = error
            abort = getattr(self.backend, "abort", None)
            if abort is not None and self.device.type == "cuda":  # NCCL: kernels waiting on the peer end
                bounded(abort, _TEARDOWN_S)
        now = time.monotonic()
        while self._queue:
            transfer = self._queue.popleft()
            transfer.error, transfer.finished_at = self._failure, now
            self._finished.append(transfer)
            transfer.done.set()

    def fail(self, reason: str) -> None:
        """Fail the link from outside (the peer's process is known to be gone)."""
        with self._lock:
            self._fail_locked(KVTransferError(reason))
            self._lock.notify_all()

    def close(self) -> None:
        """Stop the waiter; transfers still in flight fail. Bounded (the waiter is a daemon)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._queue:
                self._fail_locked(KVTransferError("the KV link was closed with transfers in flight"))
            self._lock.notify_all()
        self._waiter.join(2.0)
        shutdown = getattr(self.backend, "shutdown", None) if self._failure is None else None
        if shutdown is not None and self.device.type == "cuda":
            bounded(shutdown, _TEARDOWN_S)


def _on(stream):
    """`torch.cuda.stream(stream)`, or nothing for None (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
