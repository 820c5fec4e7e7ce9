"""The `Policy` interface: ordering, victim choice, and whether to preempt by swap or recompute.

A new policy is one small file: subclass `Policy`, override the keys (and `may_preempt` if a
waiting request may force out a running one), register it with `@register_policy("name")`,
and add `conf/policy/<name>.yaml`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from policies.registry import Registry
from policies.sequence import Sequence

PREEMPTION_MODES = ("recompute", "swap")
POLICIES: Registry[type[Policy]] = Registry("scheduling policy", field="policy")


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    register = POLICIES.register(name)

    def wrap(cls: type[Policy]) -> type[Policy]:
        cls.name = name
        return register(cls)
    return wrap


def available_policies() -> list[str]:
    return POLICIES.names()


def make_policy(name: str, **kwargs: Any) -> Policy:
    return POLICIES.get(name)(**kwargs)


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
