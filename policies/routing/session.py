"""`session`: keep each session on one replica (its prefix cache then holds the earlier turns).

The key is the request's `session_id` (or its `tenant` with `key: tenant`). A key seen before goes
to the replica it went to, if that replica is offered; a new key, a key whose replica is not offered,
and a request without a key go to the least loaded replica (`Router.least_loaded`). At most
`max_sessions` keys are remembered (the least recently used forgotten first).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from policies.request import Request
from policies.routing.base import Router, RouterConfig, check, register_router
from policies.routing.snapshot import ReplicaSnapshot

SESSION_KEYS = ("session_id", "tenant")


@dataclass(slots=True, frozen=True)
class SessionConfig(RouterConfig):
    name: str = "session"
    key: str = "session_id"
    max_sessions: int = 1_000_000

    def __post_init__(self) -> None:
        RouterConfig.__post_init__(self)
        check(self.key in SESSION_KEYS, "key", self.key, f"choose one of {list(SESSION_KEYS)}")
        m = self.max_sessions
        check(isinstance(m, int) and not isinstance(m, bool) and m >= 1, "max_sessions", m,
              "must be an integer >= 1")


@register_router("session")
class SessionRouter(Router):
    config_type = SessionConfig
    config: SessionConfig

    def __init__(self, config: RouterConfig | None = None, seed: int = 0) -> None:
        super().__init__(config, seed)
        self._home: OrderedDict[str, int] = OrderedDict()  # key -> replica

    def choose(self, request: Request, replicas: Sequence[ReplicaSnapshot]) -> int:
        key = getattr(request, self.config.key)
        if key is None:
            return self.least_loaded(replicas)
        home = self._home.get(key)
        if home is None or all(s.replica != home for s in replicas):
            home = self.least_loaded(replicas)
        self._home[key] = home
        self._home.move_to_end(key)
        if len(self._home) > self.config.max_sessions:
            self._home.popitem(last=False)
        return home
