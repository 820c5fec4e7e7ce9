"""Scheduling policies, selectable by name: `make_policy("fcfs")`, `make_policy("priority",
preemption_mode="swap", preempt_running=False)`.

Registered: fcfs, priority, sjf and srpt (on an output-length prediction), mlfq (FastServe's
skip-join multi-level feedback queue), vtc (Virtual Token Counter fair share across tenants).

A new policy is one small file, e.g. `policies/policy/spf.py` (shortest prompt first):

    from policies.policy.base import Policy, register_policy

    @register_policy("spf")
    class ShortestPromptFirst(Policy):
        def key(self, seq):  # smaller = served first; also orders the running and swapped queues
            return (seq.num_prompt_tokens, seq.request.arrival_time, seq.arrival_index, seq.seq_id)

plus one import line below and `conf/policy/sjf.yaml`. Override `pick_victim(running)` to choose
whom to preempt when KV runs out (default: the largest key) and `may_preempt(waiting, running)` to
let a waiting request force a running one out (default: never). A key that changes while a
sequence is queued is declared in `reorders` (policies/policy/base.py).
"""
from policies.policy.base import PREEMPTION_MODES, Policy, available_policies, make_policy, register_policy
from policies.policy.fcfs import FCFSPolicy
from policies.policy.mlfq import SkipJoinMLFQPolicy
from policies.policy.priority import PriorityPolicy
from policies.policy.sjf import ShortestJobFirstPolicy
from policies.policy.srpt import ShortestRemainingTimePolicy
from policies.policy.vtc import VirtualTokenCounterPolicy

__all__ = [
           "PREEMPTION_MODES",
           "FCFSPolicy",
           "Policy",
           "PriorityPolicy",
           "ShortestJobFirstPolicy",
           "ShortestRemainingTimePolicy",
           "SkipJoinMLFQPolicy",
           "VirtualTokenCounterPolicy",
           "available_policies",
           "make_policy",
           "register_policy",
]
