"""Shortest remaining processing time: the sequence predicted to have the fewest tokens left first.

Remaining work is `predicted - generated` (negative once a sequence outlives its prediction: it is
then the most overdue, and served first), plus the same optional `aging` term as sjf. The key falls
as a running sequence generates tokens, so the running queue is declared in `reorders` (a waiting or
swapped sequence generates nothing, so those queues keep their order); one token for every running
sequence keeps their order, so a steady decode needs no re-sort. With `preempt_running` (default)
the waiting head forces out running sequences with more work left when it cannot be admitted:
preemptive SRPT, at token granularity.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from policies.length_predictor import OutputLengthPredictor
from policies.policy.base import OrderHint, Policy, register_policy
from policies.policy.sjf import SJFConfig, as_predictor, check_aging
from policies.queues import SchedulerQueues
from policies.sequence import Sequence

RUNNING_ONLY = frozenset({"running"})


@dataclass(kw_only=True)
class SRPTConfig(SJFConfig):
    preempt_running: bool = True  # the waiting head may force out running sequences with more work left


@register_policy("srpt", config=SRPTConfig)
class ShortestRemainingTimePolicy(Policy):
    reorders = RUNNING_ONLY
    may_preempt_suffix = True

    def __init__(self, preemption_mode: str = "recompute", predictor: OutputLengthPredictor | str = "max_tokens",
                 aging: float = 0.0, preempt_running: bool = True) -> None:
        super().__init__(preemption_mode)
        if type(preempt_running) is not bool:
            raise ValueError(f"preempt_running={preempt_running!r} is invalid: must be True or False")
        self.predictor = as_predictor(predictor)
        self.aging = check_aging(aging)
        self.preempt_running = preempt_running

    def remaining(self, seq: Sequence) -> float:
        request = seq.request
        return (self.predictor.predict(request) - (len(seq.token_ids) - seq.num_prompt_tokens)
                + self.aging * request.arrival_time)

    def key(self, seq: Sequence) -> tuple:
        return (self.remaining(seq), seq.request.arrival_time, seq.arrival_index, seq.seq_id)

    def refresh(self, queues: SchedulerQueues, hint: OrderHint) -> Collection[str]:
        return () if hint.uniform_progress else RUNNING_ONLY

    def may_preempt(self, waiting: Sequence, running: Sequence) -> bool:
        return self.preempt_running and self.remaining(waiting) < self.remaining(running)
