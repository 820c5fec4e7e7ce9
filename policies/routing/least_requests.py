"""`least_requests`: the replica with the fewest outstanding requests (routed and not ended), as
vLLM's and SGLang's shortest-queue routers; ties go to the lowest id."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.request import Request
from policies.routing.base import Router, RouterConfig, register_router
from policies.routing.snapshot import ReplicaSnapshot


@dataclass(slots=True, frozen=True)
class LeastRequestsConfig(RouterConfig):
    name: str = "least_requests"


@register_router("least_requests")
class LeastRequestsRouter(Router):
    config_type = LeastRequestsConfig

    def choose(self, request: Request, replicas: Sequence[ReplicaSnapshot]) -> int:
        return self.least_loaded(replicas)
