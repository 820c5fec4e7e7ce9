"""One message of the KV link (engine/disagg/kv_transfer.py), the part both ends agree on: which
blocks it carries (`parts`: request id and block ids, in staging order, checked by `checked_parts`),
how they lie in the staging buffer (`staging_shape`: `[2 x layers, blocks, block_size, kv_heads,
head_dim]`, K of layer l at 2l and V at 2l + 1, the order of `interleaved`), and a message's state
in flight on one end (`Transfer`), which ends done or with a `KVTransferError`. How a message moves
(the backend, its streams, the completion waiter and the bounds) is the link's."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class KVTransferError(RuntimeError):
    """The link to the peer failed (it died, hung past the bound, or refused a message)."""


@dataclass(slots=True)
class Transfer:
    """One message in flight on a link: the blocks of one or more requests, in `parts` order."""

    parts: list[tuple[str, list[int]]]  # (request id, its block ids on this side), in staging order
    staging: torch.Tensor = field(repr=False)
    work: object = field(repr=False)
    posted_at: float  # time.monotonic()
    finished_at: float | None = None
    error: KVTransferError | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def keys(self) -> list[str]:
        return [key for key, _ in self.parts]

    @property
    def block_ids(self) -> list[int]:
        return [b for _, blocks in self.parts for b in blocks]

    @property
    def num_bytes(self) -> int:
        return self.staging.numel() * self.staging.element_size()

    @property
    def seconds(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.posted_at


def staging_shape(k_caches: Sequence[torch.Tensor], num_blocks: int) -> tuple[int, ...]:
    """The staging buffer of `num_blocks` blocks of these caches (K and V of every layer)."""
    return (2 * len(k_caches), num_blocks, *k_caches[0].shape[1:])


def interleaved(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """K of layer l at 2l, V at 2l + 1: the staging buffer's order."""
    return [cache for pair in zip(k_caches, v_caches, strict=True) for cache in pair]


def checked_parts(parts: Sequence[tuple[str, list[int]]], num_blocks: int) -> list[tuple[str, list[int]]]:
    """A transfer's (request id, block ids) parts as lists; a ValueError unless there is at least one
    part, each with at least one block, every block id in [0, num_blocks) and none twice."""
    parts = [(key, list(blocks)) for key, blocks in parts]
    if not parts or any(not blocks for _, blocks in parts):
        raise ValueError(f"parts={[(k, len(b)) for k, b in parts][:5]} is invalid: a transfer moves at least one "
                         "request, each with at least one block")
    block_ids = [b for _, blocks in parts for b in blocks]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:5]} are out of range [0, {num_blocks})")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"block ids {block_ids[:10]} are invalid: a transfer moves each block once")
    return parts
