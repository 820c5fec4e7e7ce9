"""The policies' and the scheduler's shortcuts decide exactly what the plain definitions decide.

Each policy with a shortcut runs the property tests' random workloads twice: as registered, and as a
"plain" subclass that computes its key afresh from the definition, re-sorts every queue it declares
at every step, counts service sequence by sequence, and chooses its victims from the full list of
candidates (a `pick_victim` of its own, so that the preemptor takes no shortcut either). The two
traces (every step row and every event) must be identical. Shortcuts under test: mlfq's kept keys,
srpt's and vtc's narrowed re-sorts, vtc's per-tenant counts of a steady decode, and the preemptor's
tail victim for a `may_preempt_suffix` policy (priority, srpt, mlfq).
"""
from __future__ import annotations

import copy
from collections.abc import Collection

import pytest
from hypothesis import HealthCheck, given, settings
from property_settings import examples
from test_scheduler_properties import run_workload, workloads

from policies.outputs import SchedulerOutput
from policies.policy.base import OrderHint, Policy
from policies.policy.mlfq import SkipJoinMLFQPolicy
from policies.policy.priority import PriorityPolicy
from policies.policy.srpt import ShortestRemainingTimePolicy
from policies.policy.vtc import VirtualTokenCounterPolicy
from policies.queues import SchedulerQueues
from policies.sequence import Sequence


class PlainVictims(Policy):
    """Victims chosen from every candidate by the key (the base policy's definition)."""

    may_preempt_suffix = False

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        return max(running, key=self.key)


class PlainPriority(PlainVictims, PriorityPolicy):
    pass


class PlainSRPT(PlainVictims, ShortestRemainingTimePolicy):
    def refresh(self, queues: SchedulerQueues, hint: OrderHint) -> Collection[str]:
        return self.reorders


class PlainMLFQ(PlainVictims, SkipJoinMLFQPolicy):
    def key(self, seq: Sequence) -> tuple:
        level, used = self.entry_level(seq), seq.num_output_tokens
        while level < len(self.quanta) - 1 and used >= self.quanta[level]:
            used -= self.quanta[level]
            level += 1
        return (level, seq.request.arrival_time, seq.arrival_index, seq.seq_id)


class PlainVTC(PlainVictims, VirtualTokenCounterPolicy):
    def refresh(self, queues: SchedulerQueues, hint: OrderHint) -> Collection[str]:
        super().refresh(queues, hint)
        return self.reorders

    def observe(self, out: SchedulerOutput) -> None:
        for seq, num_new, num_samples in out.scheduled:
            prompt = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens) - seq.num_computed_tokens
            self._charge(seq.request.tenant, self.input_weight * max(prompt, 0) + self.output_weight * num_samples)


PLAIN = [(PriorityPolicy, PlainPriority), (ShortestRemainingTimePolicy, PlainSRPT),
         (SkipJoinMLFQPolicy, PlainMLFQ), (VirtualTokenCounterPolicy, PlainVTC)]
COMBOS = [(fast, plain, blocks, mode) for fast, plain in PLAIN
          for blocks in ("paged", "prefix") for mode in ("recompute", "swap")]


def trace(policy: type[Policy], blocks: str, mode: str, workload) -> tuple[list, list]:
    config, specs, seed = copy.deepcopy(workload)
    scheduler, _ = run_workload(policy, blocks, mode, config, specs, seed)
    return scheduler.recorder.steps, scheduler.recorder.events


@pytest.mark.parametrize("fast, plain, blocks, mode", COMBOS, ids=lambda p: getattr(p, "name", p))
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_shortcuts_decide_as_the_definitions(fast, plain, blocks, mode, workload):
    assert trace(fast, blocks, mode, workload) == trace(plain, blocks, mode, workload)
