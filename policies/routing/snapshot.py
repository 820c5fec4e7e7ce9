"""What a router sees of one replica: a `ReplicaSnapshot`, observed from the replica's scheduler.

A snapshot is taken at one moment (`taken_at`) and may be older than the routing decision that
reads it: the fleet refreshes snapshots every `refresh_s` seconds (0: at every decision), so the
cost of stale load signals can be studied. Both backends build snapshots with `observe`, from the
same `policies.Scheduler` state, so a router decides alike in the simulator and in the engine.

The prefix index is the set of chained block hashes (policies/blocks/prefix.py:block_hash) the
replica's prefix cache holds, cached-but-unreferenced blocks included (a later request revives
them). `prompt_block_hashes` hashes a prompt the same way, so the longest run of a prompt's leading
hashes found in a replica's index is the prefix that replica would serve from cache.
"""
from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from policies.blocks.prefix import ROOT_HASH, block_hash


@dataclass(slots=True, frozen=True)
class ReplicaSnapshot:
    replica: int  # the replica's id (its index in the fleet)
    taken_at: float  # the clock when it was observed
    num_waiting: int  # sequences waiting to be admitted
    num_running: int
    num_swapped: int
    num_outstanding: int  # requests routed to the replica and not ended (waiting for admission included)
    kv_blocks_used: int  # GPU KV blocks held (cached-but-unreferenced ones count as free)
    kv_blocks_total: int
    kv_tokens: int  # token slots whose KV the running sequences hold
    block_size: int
    cached_blocks: AbstractSet[int]  # chained hashes of the full blocks its prefix cache holds

    @property
    def kv_usage(self) -> float:
        """Fraction of the GPU KV blocks in use, in [0, 1]."""
        return self.kv_blocks_used / self.kv_blocks_total

    def cached_prefix_blocks(self, hashes: list[int]) -> int:
        """How many of a prompt's leading full blocks (`prompt_block_hashes`) this replica holds."""
        cached, n = self.cached_blocks, 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n


def observe(replica: int, scheduler, num_outstanding: int, now: float, copy_index: bool) -> ReplicaSnapshot:
    """A snapshot of `scheduler` (a `policies.Scheduler`) now. `copy_index`: freeze the prefix index
    (a snapshot kept for later decisions, or sent to another process: a frozenset pickles);
    otherwise it is a live view of the block manager's table, exact only at `now`."""
    waiting, running, swapped, used, total, kv_tokens, block_size = scheduler_counts(scheduler)
    cached = scheduler.block_manager.cached_block_hashes()
    return ReplicaSnapshot(replica, now, waiting, running, swapped, num_outstanding, used, total, kv_tokens,
                           block_size, frozenset(cached) if copy_index and cached else cached)


def scheduler_counts(scheduler) -> tuple[int, int, int, int, int, int, int]:
    """(waiting, running, swapped, KV blocks used, KV blocks total, KV tokens, block size) of a
    `policies.Scheduler`: what `observe` and a remote replica's report (replica_report.py) read."""
    bm = scheduler.block_manager
    usage = bm.usage()
    return (scheduler.num_waiting, scheduler.num_running, scheduler.num_swapped, usage.gpu_used, usage.gpu_total,
            scheduler.queues.kv_tokens, bm.block_size)


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of a prompt's full blocks that a prefix cache can serve: every full block but
    one holding the prompt's last token (the block manager always computes that one)."""
    hashes, parent = [], ROOT_HASH
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
