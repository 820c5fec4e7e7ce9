"""The `Policy` interface: ordering, victim choice, and whether to preempt by swap or recompute.

A new policy is one small file: subclass `Policy`, override the keys (and `may_preempt` if a
waiting request may force out a running one), register it with `@register_policy("name")`,
and add `conf/policy/<name>.yaml`.

Keys that change over time. The queues are kept in key order by insertion (bisection) and are
never re-sorted unless the policy says so: a key that reads something that changes while a sequence
sits in a queue (its generated tokens, the clock, its tenant's service) must be declared in
`reorders`, the names of the queues whose order it can change. The scheduler then, at the start of
every step, calls `refresh` (where the policy updates what its keys read and may narrow the
queues to re-sort) and re-sorts those queues before any decision reads them. A static key pays
nothing. A key that changes but is not declared is caught by the property tests
(tests/scheduling/test_scheduler_properties.py checks every queue's order against the keys before every step,
for every registered policy).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from policies.registry import Registry, check_arguments
from policies.sequence import Sequence

if TYPE_CHECKING:
    from policies.outputs import SchedulerOutput
    from policies.queues import SchedulerQueues

PREEMPTION_MODES = ("recompute", "swap")
QUEUE_NAMES = ("waiting", "running", "swapped")
POLICIES: Registry[type[Policy]] = Registry("scheduling policy", field="policy", group="policy", key="name")


@dataclass(kw_only=True)
class PolicyConfig:
    """The knobs every policy has; a policy with more subclasses this (conf/policy/<name>.yaml holds
    them). The fields are the policy's constructor arguments, with the same defaults."""

    name: str | None = None  # the registered name (conf/policy yaml's `name`)
    preemption_mode: str = "recompute"  # recompute | swap


def register_policy(name: str, config: type[PolicyConfig] = PolicyConfig) -> Callable[[type[Policy]], type[Policy]]:
    """Register a policy under `name` with its config dataclass (whose fields, but `name`, are the
    policy's constructor arguments: checked here)."""
    register = POLICIES.register(name, config=config)

    def wrap(cls: type[Policy]) -> type[Policy]:
        check_arguments(cls, config, exclude=frozenset({"name"}))
        cls.name = name
        return register(cls)
    return wrap


def available_policies() -> list[str]:
    return POLICIES.names()


def make_policy(name: str, **kwargs: Any) -> Policy:
    """A policy by name, its constructor arguments as keywords (`make_policy("srpt", aging=1.0)`)."""
    return POLICIES.get(name)(**kwargs)


@dataclass(slots=True, frozen=True)
class OrderHint:
    """What `refresh` is told about the time since the last refresh."""

    now: float
    # The running queue is the same set of sequences as when the last step was decided, and each of
    # them gained the same number of tokens since (steady decode): a key that falls by the same
    # amount per generated token (remaining work) keeps the running queue's order.
    uniform_progress: bool


class Policy(ABC):
    name: str = "base"
    # The queues (QUEUE_NAMES) whose order the key can change while sequences sit in them (module
    # docstring). Empty: the key of a queued sequence never changes.
    reorders: frozenset[str] = frozenset()
    # Whether, for any waiting sequence, the running sequences it `may_preempt` are a suffix of the
    # running queue in key order (it compares a leading part of the keys). The waiting head's
    # victim is then the running queue's tail or none, found in one check instead of one per
    # running sequence. Checked by the property tests for every policy that declares it.
    may_preempt_suffix: bool = False

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

    def refresh(self, queues: SchedulerQueues, hint: OrderHint) -> Collection[str]:
        """For a policy with `reorders`, at the start of every step before anything is decided:
        bring what the keys read up to date (the clock, counters) and return the queues whose order
        may have changed since the last refresh (default: all of `reorders`); the scheduler
        re-sorts them. `queues` is for reading only."""
        return self.reorders

    def observe(self, out: SchedulerOutput) -> None:
        """Called with every step once it is decided (for policies that count service). A key must
        not change here: apply what was observed in the next `refresh`."""

    def observe_decode_run(self, running: list[Sequence], num_steps: int) -> Collection[str]:
        """Called when a decode run (the simulator's fast-forward) gives every running sequence
        `num_steps` more tokens without a `schedule` per step: as `refresh` (with nothing waiting or
        swapped) then `observe`, once per step. Returns the queues whose order may have changed, as
        `refresh` (default: none)."""
        return ()
