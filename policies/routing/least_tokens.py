"""`least_tokens`: the replica whose running sequences hold the fewest KV tokens (absolute, unlike
`least_kv`'s fraction of the pool); ties go to the fewest outstanding requests, then the lowest id."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.request import Request
from policies.routing.base import Router, RouterConfig, register_router
from policies.routing.snapshot import ReplicaSnapshot


@dataclass(slots=True, frozen=True)
class LeastTokensConfig(RouterConfig):
    name: str = "least_tokens"


@register_router("least_tokens")
class LeastTokensRouter(Router):
    config_type = LeastTokensConfig

    def choose(self, request: Request, replicas: Sequence[ReplicaSnapshot]) -> int:
        return min(replicas, key=lambda s: (s.kv_tokens, self.load(s), s.replica)).replica
