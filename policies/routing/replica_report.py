"""A replica that runs in another process reports its state; the router's side mirrors it.

The simulated fleet observes every replica's scheduler directly (`snapshot.observe`). An engine
replica's scheduler lives in its engine core process, so after each step the core sends a
`ReplicaReport` (`report`: the same scheduler fields `observe` reads, and the changes to its
prefix index since its last report, as vLLM's KV-cache events do), and the front end keeps one
`ReplicaView` per replica that applies the reports and builds the `ReplicaSnapshot` a router reads.
A view's snapshot equals what `observe` gives on the replica's scheduler as of its last report, so
a router decides alike on both sides (tests/serving/test_fleet_routing_parity.py).

Staleness (`RefreshClock`): with `refresh_s` = 0 every decision reads the newest reports; with
`refresh_s` > 0 the snapshots are rebuilt at the first decision at or after each multiple of
`refresh_s` and read by every decision until the next, as the simulated fleet's refreshes are.
`RemoteFleet` puts these together: the router's side of N such replicas.
"""
from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from math import floor, inf

from policies.request import Request
from policies.routing.base import Router
from policies.routing.snapshot import ReplicaSnapshot, scheduler_counts


@dataclass(slots=True, frozen=True)
class ReplicaReport:
    num_waiting: int
    num_running: int
    num_swapped: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_tokens: int
    block_size: int
    index_added: tuple[int, ...] = ()  # prefix-index hashes cached since the last report
    index_removed: tuple[int, ...] = ()  # ... and evicted since


def report(scheduler, sent_index: set[int] | None) -> ReplicaReport:
    """The scheduler's report now. `sent_index`: the prefix index as of the last report, updated in
    place to the current one (its changes go into the report); None: no index is reported."""
    counts = scheduler_counts(scheduler)
    if sent_index is None:
        return ReplicaReport(*counts)
    cached = scheduler.block_manager.cached_block_hashes()
    added = tuple(h for h in cached if h not in sent_index)
    removed = tuple(h for h in sent_index if h not in cached)
    sent_index.difference_update(removed)
    sent_index.update(added)
    return ReplicaReport(*counts, added, removed)


@dataclass(slots=True)
class ReplicaView:
    """The router's side of one replica: its newest report and its prefix index as reported."""

    replica: int
    last: ReplicaReport | None = None
    index: set[int] = field(default_factory=set)

    def update(self, r: ReplicaReport) -> None:
        self.index.difference_update(r.index_removed)
        self.index.update(r.index_added)
        self.last = r

    def snapshot(self, num_outstanding: int, now: float, copy_index: bool, block_size: int,
                 kv_blocks_total: int) -> ReplicaSnapshot:
        """The snapshot a router reads. Before the first report the replica is idle and empty
        (`block_size`, `kv_blocks_total`: its pool). `copy_index` as in `observe`."""
        r = self.last
        if r is None:
            r = ReplicaReport(0, 0, 0, 0, kv_blocks_total, 0, block_size)
        index: AbstractSet[int] = frozenset(self.index) if copy_index else self.index
        return ReplicaSnapshot(self.replica, now, r.num_waiting, r.num_running, r.num_swapped, num_outstanding,
                               r.kv_blocks_used, r.kv_blocks_total, r.kv_tokens, r.block_size, index)


@dataclass(slots=True)
class RefreshClock:
    """When snapshots kept for several decisions are rebuilt (module docstring)."""

    refresh_s: float
    _taken: int = -1  # index k of the refresh at k x refresh_s the kept snapshots stand for

    def due(self, now: float) -> bool:
        """True when the kept snapshots are older than the last refresh at or before `now` (always
        with refresh_s = 0); the caller then rebuilds them."""
        if not self.refresh_s:
            return True
        k = floor(now / self.refresh_s)
        if k > self._taken:
            self._taken = k
            return True
        return False


class RemoteFleet:
    """The router's side of replicas that run elsewhere (engine core processes, Ray actors): one
    `ReplicaView` per replica, the requests routed to each and not ended (`num_outstanding`, exact:
    counted here), which replicas serve, and the refresh clock. The engine's replica set
    (engine/online/replica_set.py) and the experiments' engine fleet (experiments/lib/engine_fleet.py)
    route through it, so both build the snapshots alike."""

    def __init__(self, router: Router, pools: list[tuple[int, int]], refresh_s: float = 0.0) -> None:
        """`pools`: each replica's (block size, GPU KV blocks), for its snapshots before its first report."""
        if isinstance(refresh_s, bool) or not isinstance(refresh_s, (int, float)) or not 0 <= refresh_s < inf:
            raise ValueError(f"refresh_s={refresh_s!r} is invalid: must be a finite number >= 0 (0: exact)")
        self.router = router
        self.pools = list(pools)
        self.refresh_s = float(refresh_s)
        self.views = [ReplicaView(i) for i in range(len(pools))]
        self.outstanding = [0] * len(pools)
        self.num_routed = [0] * len(pools)
        self.alive = [True] * len(pools)
        self._clock = RefreshClock(self.refresh_s)
        self._kept: list[ReplicaSnapshot] = []  # read until the next refresh (refresh_s > 0)

    def snapshot(self, replica: int, now: float, copy_index: bool) -> ReplicaSnapshot:
        block_size, num_blocks = self.pools[replica]
        return self.views[replica].snapshot(self.outstanding[replica], now, copy_index, block_size, num_blocks)

    def snapshots(self, now: float) -> list[ReplicaSnapshot]:
        """What the router reads now: one snapshot per live replica (module docstring)."""
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not self.refresh_s:
            return [self.snapshot(i, now, copy_index=False) for i in live]
        if self._clock.due(now):
            self._kept = [self.snapshot(i, now, copy_index=True) for i in live]
        return [s for s in self._kept if self.alive[s.replica]]

    def route(self, request: Request, now: float) -> int:
        """The replica the router picks for `request` at `now`; it counts as outstanding there."""
        chosen = self.router.route(request, self.snapshots(now))
        self.outstanding[chosen] += 1
        self.num_routed[chosen] += 1
        return chosen

    def update(self, replica: int, r: ReplicaReport) -> None:
        self.views[replica].update(r)

    def ended(self, replica: int, n: int = 1) -> None:
        """`n` requests routed to `replica` ended."""
        self.outstanding[replica] -= n

    def lose(self, replica: int) -> None:
        """The replica stopped: no request is routed to it any more."""
        self.alive[replica] = False
        self.outstanding[replica] = 0
