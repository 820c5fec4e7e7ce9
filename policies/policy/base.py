"""The `Policy` interface: ordering, victim choice, and whether to preempt by swap or recompute.

A new policy is one small file: subclass `Policy`, override the keys (and `may_preempt` if a
waiting request may force out a running one), register it with `@register_policy("name")`,
and add `conf/policy/<name>.yaml`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from policies.sequence import Sequence

PREEMPTION_MODES = ("recompute", "swap")
_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    def wrap(cls: type[Policy]) -> type[Policy]:
        _REGISTRY[name] = cls
        cls.name = name
        return cls
    return wrap


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, **kwargs: Any) -> Policy:
    if name not in _REGISTRY:
        raise ValueError(f"policy={name!r} is unknown: choose one of {available_policies()}")
    return _REGISTRY[name](**kwargs)


class Policy(ABC):
    name: str = "base"

    def __init__(self, preemption_mode: str = "recompute") -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={preemption_mode!r} is invalid: choose one of {PREEMPTION_MODES}")
        self.preemption_mode = preemption_mode

    @abstractmethod
    def key(self, seq: Sequence) -> tuple:
        """Sort key: smaller = served first. Orders the waiting, swapped and running queues."""

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        """The running sequence to preempt when KV runs out (default: the one served last)."""
        return max(running, key=self.key)

    def may_preempt(self, waiting: Sequence, running: Sequence) -> bool:
        """Whether `waiting` may force `running` out to get admitted (default: never)."""
        return False
