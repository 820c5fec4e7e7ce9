"""Shortest job first: the request predicted to generate the fewest tokens first.

The job size is an output-length prediction (policies/length_predictor.py: `max_tokens` by default,
the workload's true lengths with `oracle`, a learned `bucket` estimate). `aging` (tokens per second
of waiting) lowers a request's key as it waits, so no long request starves: the key is
`predicted - aging * (now - arrival)`, which orders requests exactly as `predicted + aging * arrival`
does (every waiting request ages at the same rate), so the key never changes while a sequence is
queued and the queues need no re-sorting. Non-preemptive: a running request is never forced out
for a shorter one (see srpt for the preemptive variant).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.length_predictor import OutputLengthPredictor, make_predictor
from policies.policy.base import Policy, PolicyConfig, register_policy
from policies.sequence import Sequence


def as_predictor(predictor: OutputLengthPredictor | str) -> OutputLengthPredictor:
    """A predictor, or the name of one that needs no arguments (`max_tokens`)."""
    return make_predictor(predictor) if isinstance(predictor, str) else predictor


def check_aging(aging: float) -> float:
    if isinstance(aging, bool) or not isinstance(aging, (int, float)) or not 0 <= aging < float("inf"):
        raise ValueError(f"aging={aging!r} is invalid: must be a finite number >= 0 (tokens per second waited)")
    return float(aging)


@dataclass(kw_only=True)
class SJFConfig(PolicyConfig):
    # An OutputLengthPredictor, or its spec: max_tokens | oracle | {kind: noisy-oracle, sigma: 1.0} |
    # {kind: bucket, trace: null} (experiments/lib/predictors.py turns a spec into a predictor).
    predictor: Any = "max_tokens"
    aging: float = 0.0  # output tokens of priority gained per second waited (0: none)


@register_policy("sjf", config=SJFConfig)
class ShortestJobFirstPolicy(Policy):
    def __init__(self, preemption_mode: str = "recompute", predictor: OutputLengthPredictor | str = "max_tokens",
                 aging: float = 0.0) -> None:
        super().__init__(preemption_mode)
        self.predictor = as_predictor(predictor)
        self.aging = check_aging(aging)

    def key(self, seq: Sequence) -> tuple:
        request = seq.request
        size = self.predictor.predict(request) + self.aging * request.arrival_time
        return (size, request.arrival_time, seq.arrival_index, seq.seq_id)
