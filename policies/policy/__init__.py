"""Scheduling policies, selectable by name: `make_policy("fcfs")`, `make_policy("priority",
preemption_mode="swap", preempt_running=False)`.

A new policy is one small file, e.g. `policies/policy/sjf.py` (shortest prompt first):

    from policies.policy.base import Policy, register_policy

    @register_policy("sjf")
    class ShortestJobFirst(Policy):
        def key(self, seq):  # smaller = served first; also orders the running and swapped queues
            return (seq.num_prompt_tokens, seq.request.arrival_time, seq.arrival_index, seq.seq_id)

plus one import line below and `conf/policy/sjf.yaml`. Override `pick_victim(running)` to choose
whom to preempt when KV runs out (default: the largest key) and `may_preempt(waiting, running)` to
let a waiting request force a running one out (default: never).
"""
from policies.policy.base import PREEMPTION_MODES, Policy, available_policies, make_policy, register_policy
from policies.policy.fcfs import FCFSPolicy
from policies.policy.priority import PriorityPolicy

__all__ = [
           "PREEMPTION_MODES",
           "FCFSPolicy",
           "Policy",
           "PriorityPolicy",
           "available_policies",
           "make_policy",
           "register_policy",
]
