"""Policies: keys, victims, force-preemption rules, the registry, and a new policy in a few lines."""
from __future__ import annotations

import pytest
from scheduler_helpers import compact, make_scheduler, request, run_to_end

from policies import Request, SamplingParams, Sequence, make_policy
from policies.policy import FCFSPolicy, Policy, PriorityPolicy, available_policies, register_policy


def seq(seq_id: int, arrival: float, priority: int = 0, arrival_index: int = 0, prompt_len: int = 4) -> Sequence:
    s = Sequence.from_request(seq_id, Request(f"r{seq_id}", [1] * prompt_len, SamplingParams(),
                                              arrival_time=arrival, priority=priority))
    s.arrival_index = arrival_index
    return s


def test_registry_and_factory():
    assert {"fcfs", "priority"} <= set(available_policies())
    assert isinstance(make_policy("fcfs"), FCFSPolicy)
    p = make_policy("priority", preemption_mode="swap", preempt_running=False)
    assert isinstance(p, PriorityPolicy) and p.preemption_mode == "swap" and not p.preempt_running
    with pytest.raises(ValueError, match="policy='lifo'"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="preemption_mode"):
        make_policy("fcfs", preemption_mode="drop")
    with pytest.raises(ValueError, match="preempt_running"):
        make_policy("priority", preempt_running="yes")


def test_fcfs_orders_by_arrival_then_add_order_and_evicts_the_latest():
    fcfs = make_policy("fcfs")
    a, b, c = seq(0, 1.0, arrival_index=1), seq(1, 1.0, arrival_index=0), seq(2, 0.5, arrival_index=2)
    assert sorted([a, b, c], key=fcfs.key) == [c, b, a]
    assert fcfs.pick_victim([a, b, c]) is a
    assert not fcfs.may_preempt(c, a)


def test_priority_orders_by_priority_then_arrival_and_preempts_only_less_urgent():
    prio = make_policy("priority")
    urgent, late_urgent, lazy = seq(0, 5.0, priority=0), seq(1, 6.0, priority=0), seq(2, 1.0, priority=3)
    assert sorted([lazy, late_urgent, urgent], key=prio.key) == [urgent, late_urgent, lazy]
    assert prio.pick_victim([urgent, lazy, late_urgent]) is lazy
    assert prio.may_preempt(urgent, lazy) and not prio.may_preempt(lazy, urgent)
    assert not prio.may_preempt(urgent, late_urgent)  # equal priority never preempts
    assert not make_policy("priority", preempt_running=False).may_preempt(urgent, lazy)


@register_policy("test-shortest-prompt")
class ShortestPromptFirst(Policy):
    """The docstring example of policies/policy/__init__.py, plus a custom victim rule."""

    def key(self, s: Sequence) -> tuple:
        return (s.num_prompt_tokens, s.request.arrival_time, s.arrival_index, s.seq_id)

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        return min(running, key=lambda s: s.num_tokens)  # evict the cheapest to recompute


def test_a_new_policy_is_one_small_class_and_drives_the_scheduler():
    s = make_scheduler("test-shortest-prompt", max_num_batched_tokens=16, max_num_seqs=1)
    for i, length in enumerate([12, 4, 8]):
        s.add(request(f"len{length}", length, 1, arrival=i), now=0.0)
    order = [compact(out)[0][0] for out in run_to_end(s)]
    assert order == ["len4/0", "len8/0", "len12/0"]


def first_victim(policy: str) -> str:
    # 5 blocks of 4: prompts of 4, 5, 6 tokens hold 1 + 2 + 2 blocks; at step 1 "a" needs a new block.
    s = make_scheduler(policy, num_gpu_blocks=5, max_num_batched_tokens=32)
    for i, length in enumerate([4, 5, 6]):
        s.add(request("abc"[i], length, 10, arrival=i), now=0.0)
    outs = run_to_end(s)
    return next(x.request.request_id for out in outs for x in out.preempted)


def test_a_custom_victim_rule_is_used_for_preemption():
    assert first_victim("fcfs") == "c"  # default: the largest key
    assert first_victim("test-shortest-prompt") == "a"  # fewest tokens: "a" itself
