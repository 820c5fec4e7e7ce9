"""The KV link's start-up transfer: one block moved from the prefill end to the decode end through
the serving path (engine/disagg/kv_transfer.py: the gather into a staging buffer, the send/recv on
the link's own backend, the scatter into the cache) before the pair reports ready, so nothing that
path sets up on first use is paid by the first request: the Triton gather/scatter kernels are
compiled (or loaded from the cache) and their pointer tables built, NCCL's point-to-point
communicator for the pair and its connections exist, the staging memory and the pinned index
buffers are allocated, and the link's completion waiter has run once.

Which memory it touches: block `WARM_BLOCK` (0) of each KV cache, free at start-up (nothing is
allocated before the pair reports ready). The sender only reads it. The receiver copies its block
aside, receives into it, and writes the copy back, so no KV block's contents change.

Both ends are bounded by the link's `timeout_s`: a peer that dies or hangs fails the transfer
(`KVTransferError`) within it.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kernels
from engine.disagg.kv_transfer import KVLink
from engine.disagg.kv_transfer_message import KVTransferError, Transfer, interleaved, staging_shape

WARM_BLOCK = 0
WARM_KEY = "kv-link-warm-up"


@dataclass(slots=True, frozen=True)
class WarmTransfer:
    """What one end's start-up transfer took."""

    seconds: float  # posting to its end (the receiver's: to its scatter and the restore)
    num_bytes: int


def warm_send(link: KVLink, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> WarmTransfer:
    """The prefill end: block 0 gathered and sent as one message; waits (bounded) for its end."""
    start = time.monotonic()
    transfer = link.send([(WARM_KEY, [WARM_BLOCK])], k_caches, v_caches)
    _await(link, transfer)
    return WarmTransfer(time.monotonic() - start, transfer.num_bytes)


def warm_recv(link: KVLink, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> WarmTransfer:
    """The decode end: block 0 received and scattered into its place as a hand-off's blocks are,
    then its previous contents written back."""
    start = time.monotonic()
    caches = interleaved(k_caches, v_caches)
    index = torch.tensor([WARM_BLOCK], dtype=torch.int64, device=k_caches[0].device)
    saved = torch.empty(staging_shape(k_caches, 1), dtype=k_caches[0].dtype, device=k_caches[0].device)
    kernels.gather_blocks(caches, index, saved)
    transfer = link.recv([(WARM_KEY, [WARM_BLOCK])], k_caches)
    _await(link, transfer)
    link.scatter(transfer, k_caches, v_caches)
    kernels.scatter_blocks(saved, caches, index)
    if k_caches[0].device.type == "cuda":
        torch.cuda.synchronize(k_caches[0].device)
    return WarmTransfer(time.monotonic() - start, transfer.num_bytes)


def _await(link: KVLink, transfer: Transfer) -> None:
    """The transfer's end, within the link's bound (its waiter fails it at `timeout_s` without
    progress; the margin covers the waiter's wake-up)."""
    link.wait_all(link.timeout_s + 2.0)
    if transfer.error is not None:
        raise transfer.error
    if not transfer.done.is_set():
        raise KVTransferError(f"the KV link's start-up transfer did not end within timeout_s={link.timeout_s}")
    if link.device.type == "cuda":
        torch.cuda.synchronize(link.device)
