"""`prefix_aware`: send a request where its prompt's prefix is cached, unless that unbalances the
fleet: the cache-aware policy of SGLang's router, with llm-d's prefix score as the match measure.

1. Loads (outstanding requests, `Router.load`) are imbalanced when max - min > `balance_abs_threshold`
   and max > `balance_rel_threshold` x min: the request goes to the least loaded replica.
2. Otherwise each replica's match is the number of the prompt's leading full blocks it holds
   (`ReplicaSnapshot.cached_prefix_blocks`), as a fraction of the prompt's full blocks. The replica with
   the longest match (ties: the least loaded, then the lowest id) gets the request if its fraction
   is at least `cache_threshold` and it matches at least one block.
3. Otherwise the request goes to the replica with the most free KV (ties: least loaded, lowest id),
   where its new prefix has the most room to stay cached (SGLang's "smallest tree").

With `track_routed` (default), a replica's match also counts the blocks of prompts this router sent
it, remembered per replica up to its pool's size (least recently routed forgotten first), as
SGLang's router keeps its own prefix tree: a burst of requests sharing a new prefix then follows the
first one before that replica has computed (and reported) the prefix.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from policies.request import Request
from policies.routing.base import Router, RouterConfig, check, register_router
from policies.routing.snapshot import ReplicaSnapshot, prompt_block_hashes


@dataclass(slots=True, frozen=True)
class PrefixAwareConfig(RouterConfig):
    name: str = "prefix_aware"
    cache_threshold: float = 0.5  # SGLang's default
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    track_routed: bool = True

    def __post_init__(self) -> None:
        RouterConfig.__post_init__(self)
        t, a, r = self.cache_threshold, self.balance_abs_threshold, self.balance_rel_threshold
        check(_is_number(t) and 0 <= t <= 1, "cache_threshold", t, "must be a number in [0, 1]")
        check(_is_number(a) and isinstance(a, int) and a >= 0, "balance_abs_threshold", a,
              "must be an integer >= 0")
        check(_is_number(r) and r >= 1, "balance_rel_threshold", r, "must be a number >= 1")
        check(isinstance(self.track_routed, bool), "track_routed", self.track_routed, "must be true or false")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@register_router("prefix_aware")
class PrefixAwareRouter(Router):
    config_type = PrefixAwareConfig
    config: PrefixAwareConfig
    reads_prefix_index = True

    def __init__(self, config: RouterConfig | None = None, seed: int = 0) -> None:
        super().__init__(config, seed)
        self._routed: dict[int, OrderedDict[int, None]] = {}  # replica -> block hashes sent to it

    def choose(self, request: Request, replicas: Sequence[ReplicaSnapshot]) -> int:
        cfg = self.config
        loads = {s.replica: self.load(s) for s in replicas}
        low, high = min(loads.values()), max(loads.values())
        by_size: dict[int, list[int]] = {}
        if high - low > cfg.balance_abs_threshold and high > cfg.balance_rel_threshold * low:
            chosen = min(replicas, key=lambda s: (loads[s.replica], s.replica)).replica
        else:
            best, best_key, best_frac = None, None, 0.0
            for s in replicas:
                hashes = by_size.get(s.block_size)
                if hashes is None:
                    hashes = by_size[s.block_size] = prompt_block_hashes(request.prompt_token_ids, s.block_size)
                matched = self._matched(s, hashes)
                key = (-matched, loads[s.replica], s.replica)
                if best_key is None or key < best_key:
                    best, best_key, best_frac = s.replica, key, matched / len(hashes) if hashes else 0.0
            if best_key[0] < 0 and best_frac >= cfg.cache_threshold:
                chosen = best
            else:
                chosen = min(replicas, key=lambda s: (s.kv_usage, loads[s.replica], s.replica)).replica
        if cfg.track_routed:
            snap = next(s for s in replicas if s.replica == chosen)
            hashes = by_size.get(snap.block_size)
            if hashes is None:
                hashes = prompt_block_hashes(request.prompt_token_ids, snap.block_size)
            self._remember(snap, hashes)
        return chosen

    def _matched(self, snap: ReplicaSnapshot, hashes: list[int]) -> int:
        cached = snap.cached_blocks
        routed = self._routed.get(snap.replica, {}) if self.config.track_routed else {}
        n = 0
        for h in hashes:
            if h not in cached and h not in routed:
                break
            n += 1
        return n

    def _remember(self, snap: ReplicaSnapshot, hashes: list[int]) -> None:
        routed = self._routed.setdefault(snap.replica, OrderedDict())
        for h in hashes:
            routed[h] = None
            routed.move_to_end(h)
        while len(routed) > snap.kv_blocks_total:
            routed.popitem(last=False)
