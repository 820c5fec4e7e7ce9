"""The `Router` interface: which replica of a fleet serves a request.

A router is pure Python and sees the replicas only through `ReplicaSnapshot`s (snapshot.py), so the
same router object routes in the simulated fleet (sim/fleet/) and in front of engine replicas.
`route(request, replicas)` returns the `replica` id of one of the offered snapshots (a fleet may
offer fewer replicas than it has, e.g. without one that died). Decisions are deterministic given
the seed and the snapshots.

Each router declares its own typed config (a frozen dataclass subclassing `RouterConfig`, with
its own `__post_init__` checks) as `config_type`, and registers under its name:

    @dataclass(slots=True, frozen=True)
    class FewestWaitingConfig(RouterConfig):
        name: str = "fewest_waiting"

    @register_router("fewest_waiting")
    class FewestWaiting(Router):
        config_type = FewestWaitingConfig

        def choose(self, request, replicas):
            return min(replicas, key=lambda s: (s.num_waiting, s.replica)).replica

`make_router({"name": ..., knobs...}, seed)` builds one from a config mapping; an unknown name or
knob, or a bad value, is a ValueError naming the key.

Load between refreshes. A snapshot kept for several decisions does not show the requests routed
since it was taken;
`load(snapshot)` adds them (as the production routers count their own in-flight requests) unless
the config sets `count_routed: false`, which leaves the router blind to them (herding).
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from policies.registry import Registry
from policies.request import Request
from policies.routing.snapshot import ReplicaSnapshot

ROUTERS: Registry[type[Router]] = Registry("router", field="name", group="router")


@dataclass(slots=True, frozen=True)
class RouterConfig:
    name: str = ""
    # Count the requests routed to a replica since its snapshot was taken into its load.
    count_routed: bool = True

    def __post_init__(self) -> None:
        check(isinstance(self.count_routed, bool), "count_routed", self.count_routed, "must be true or false")


def check(ok: bool, key: str, value: object, allowed: str) -> None:
    """A router config's value check: ValueError naming the key, the value and what is allowed."""
    if not ok:
        raise ValueError(f"{key}={value!r} is invalid: {allowed}")


def register_router(name: str) -> Callable[[type[Router]], type[Router]]:
    """Register a router under `name` with its config (`config_type`), the registry style of every
    pluggable kind (policies/registry.py)."""

    def wrap(cls: type[Router]) -> type[Router]:
        cls.name = name
        return ROUTERS.register(name, config=cls.config_type)(cls)
    return wrap


class Router(ABC):
    name: ClassVar[str] = "base"
    config_type: ClassVar[type[RouterConfig]] = RouterConfig
    # The router reads `ReplicaSnapshot.cached_blocks`: replicas in other processes then report
    # their prefix index (replica_report.py), which costs them a pass over it per step.
    reads_prefix_index: ClassVar[bool] = False

    def __init__(self, config: RouterConfig | None = None, seed: int = 0) -> None:
        self.config = self.config_type(name=self.name) if config is None else config
        self.seed = seed
        # replica -> (the snapshot of it last seen, requests routed to it since that one was taken)
        self._routed_since: dict[int, tuple[ReplicaSnapshot, int]] = {}

    def route(self, request: Request, replicas: Sequence[ReplicaSnapshot]) -> int:
        """The replica id to send `request` to, among `replicas` (at least one)."""
        if not replicas:
            raise ValueError(f"request {request.request_id!r} cannot be routed: no replica is available")
        chosen = self.choose(request, replicas)
        snap = next((s for s in replicas if s.replica == chosen), None)
        if snap is None:
            raise RuntimeError(f"router {self.name!r} chose replica {chosen!r}, not one of "
                               f"{[s.replica for s in replicas]}")
        seen, n = self._routed_since.get(chosen, (snap, 0))
        self._routed_since[chosen] = (snap, n + 1 if seen is snap else 1)
        return chosen

    @abstractmethod
    def choose(self, request: Request, replicas: Sequence[ReplicaSnapshot]) -> int:
        """The replica id (one of `replicas`)."""

    def routed_since(self, snap: ReplicaSnapshot) -> int:
        """Requests this router sent to `snap`'s replica after `snap` was taken."""
        seen, n = self._routed_since.get(snap.replica, (snap, 0))
        return n if seen is snap else 0

    def load(self, snap: ReplicaSnapshot) -> int:
        """Outstanding requests of a replica as this router knows them (module docstring)."""
        return snap.num_outstanding + (self.routed_since(snap) if self.config.count_routed else 0)

    def least_loaded(self, replicas: Sequence[ReplicaSnapshot]) -> int:
        """The replica with the fewest outstanding requests (ties: the lowest id)."""
        return min(replicas, key=lambda s: (self.load(s), s.replica)).replica


def make_router(cfg: Mapping[str, Any], seed: int = 0) -> Router:
    """A router from its config mapping (`name` plus the router's own keys)."""
    cfg = dict(cfg)
    cls = ROUTERS.get(cfg.get("name"))
    allowed = [f.name for f in dataclasses.fields(cls.config_type)]
    unknown = sorted(set(cfg) - set(allowed))
    if unknown:
        raise ValueError(f"{unknown[0]} is unknown for router {cls.name!r}: allowed are {allowed}")
    return cls(cls.config_type(**cfg), seed)
