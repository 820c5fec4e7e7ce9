"""Priority scheduling: lower `request.priority` = more urgent, ties by arrival (vLLM's "priority").

With `preempt_running` (default), a waiting request that cannot be admitted may force out running
sequences of strictly lower priority (larger value), least urgent first.
"""
from __future__ import annotations

from dataclasses import dataclass

from policies.policy.base import Policy, PolicyConfig, register_policy
from policies.sequence import Sequence


@dataclass(kw_only=True)
class PriorityConfig(PolicyConfig):
    preempt_running: bool = True  # a waiting request may force out running ones of lower priority


@register_policy("priority", config=PriorityConfig)
class PriorityPolicy(Policy):
    may_preempt_suffix = True

    def __init__(self, preemption_mode: str = "recompute", preempt_running: bool = True) -> None:
        super().__init__(preemption_mode)
        if type(preempt_running) is not bool:
            raise ValueError(f"preempt_running={preempt_running!r} is invalid: must be True or False")
        self.preempt_running = preempt_running

    def key(self, seq: Sequence) -> tuple:
        request = seq.request
        return (request.priority, request.arrival_time, seq.arrival_index, seq.seq_id)

    def may_preempt(self, waiting: Sequence, running: Sequence) -> bool:
        return self.preempt_running and waiting.request.priority < running.request.priority
