"""`random`: a uniformly drawn replica, from a generator seeded by the run's seed."""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from policies.request import Request
from policies.routing.base import Router, RouterConfig, register_router
from policies.routing.snapshot import ReplicaSnapshot


@dataclass(slots=True, frozen=True)
class RandomConfig(RouterConfig):
    name: str = "random"


@register_router("random")
class RandomRouter(Router):
    config_type = RandomConfig

    def __init__(self, config: RouterConfig | None = None, seed: int = 0) -> None:
        super().__init__(config, seed)
        self._rng = random.Random(seed)

    def choose(self, request: Request, replicas: Sequence[ReplicaSnapshot]) -> int:
        return sorted(s.replica for s in replicas)[self._rng.randrange(len(replicas))]
