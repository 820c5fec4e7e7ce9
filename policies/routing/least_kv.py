"""`least_kv`: the replica whose GPU KV pool is least used (fraction of blocks held, so replicas
with pools of different sizes compare fairly); ties go to the fewest outstanding requests, then
the lowest id."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.request import Request
from policies.routing.base import Router, RouterConfig, register_router
from policies.routing.snapshot import ReplicaSnapshot


@dataclass(slots=True, frozen=True)
class LeastKvConfig(RouterConfig):
    name: str = "least_kv"


@register_router("least_kv")
class LeastKvRouter(Router):
    config_type = LeastKvConfig

    def choose(self, request: Request, replicas: Sequence[ReplicaSnapshot]) -> int:
        return min(replicas, key=lambda s: (s.kv_usage, self.load(s), s.replica)).replica
