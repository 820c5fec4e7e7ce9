"""Routers: which replica of a fleet serves a request (pure Python, shared by the simulated fleet
and the engine's replicas). `make_router({"name": "prefix_aware", ...}, seed)` builds one by name;
the interface and how to add one are in base.py, what a router sees in snapshot.py.

Registered: round_robin, random, least_requests, least_kv, least_tokens, prefix_aware, session.
"""
from policies.routing.base import ROUTERS, Router, RouterConfig, make_router, register_router
from policies.routing.least_kv import LeastKvRouter
from policies.routing.least_requests import LeastRequestsRouter
from policies.routing.least_tokens import LeastTokensRouter
from policies.routing.prefix_aware import PrefixAwareRouter
from policies.routing.random_choice import RandomRouter
from policies.routing.replica_report import RefreshClock, RemoteFleet, ReplicaReport, ReplicaView, report
from policies.routing.round_robin import RoundRobinRouter
from policies.routing.session import SessionRouter
from policies.routing.snapshot import ReplicaSnapshot, observe, prompt_block_hashes

__all__ = [
    "ROUTERS",
    "LeastKvRouter",
    "LeastRequestsRouter",
    "LeastTokensRouter",
    "PrefixAwareRouter",
    "RandomRouter",
    "RefreshClock",
    "RemoteFleet",
    "ReplicaReport",
    "ReplicaSnapshot",
    "ReplicaView",
    "RoundRobinRouter",
    "Router",
    "RouterConfig",
    "SessionRouter",
    "make_router",
    "observe",
    "prompt_block_hashes",
    "register_router",
    "report",
]
