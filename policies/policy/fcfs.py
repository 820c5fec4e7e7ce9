"""First come, first served: earliest arrival first (vLLM's default policy)."""
from __future__ import annotations

from policies.policy.base import Policy, register_policy
from policies.sequence import Sequence


@register_policy("fcfs")
class FCFSPolicy(Policy):
    def key(self, seq: Sequence) -> tuple:
        # arrival_index breaks ties between equal arrival times; seq_id orders a request's samples.
        return (seq.request.arrival_time, seq.arrival_index, seq.seq_id)
