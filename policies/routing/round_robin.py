"""`round_robin`: the offered replicas in turn, whatever their load."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.request import Request
from policies.routing.base import Router, RouterConfig, register_router
from policies.routing.snapshot import ReplicaSnapshot


@dataclass(slots=True, frozen=True)
class RoundRobinConfig(RouterConfig):
    name: str = "round_robin"


@register_router("round_robin")
class RoundRobinRouter(Router):
    config_type = RoundRobinConfig

    def __init__(self, config: RouterConfig | None = None, seed: int = 0) -> None:
        super().__init__(config, seed)
        self._next = 0

    def choose(self, request: Request, replicas: Sequence[ReplicaSnapshot]) -> int:
        # The first offered replica at or after the turn's id (a fleet may offer fewer than it has).
        ids = sorted(s.replica for s in replicas)
        chosen = next((r for r in ids if r >= self._next), ids[0])
        self._next = chosen + 1
        return chosen
