"""vtc charges each step exactly the work it schedules: `input_weight` per prompt token computed and
`output_weight` per token generated, divided by the tenant's share (Sheng et al.'s service).

A recompute preemption makes a sequence compute its prompt again, and that is charged again (the
rule of policies/policy/vtc.py: service counts prompt tokens computed, so the tenant whose request
is recomputed pays for it). Prompt tokens read from the prefix cache are not computed and not
charged. The audit below counts, per step, the prompt positions each scheduled chunk computes and
the tokens it samples, from the step's entries alone, and compares with what the policy charged
(steady-decode shortcut included), through the synchronous and the schedule-ahead protocols.
"""
from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from property_settings import examples
from scheduler_helpers import KVStoreBackend, make_scheduler, request, sample_tokens
from test_scheduler_lookahead import drive
from test_scheduler_properties import run_workload, workloads

from policies.outputs import SchedulerOutput
from policies.policy.vtc import VirtualTokenCounterPolicy


class AuditedVTC(VirtualTokenCounterPolicy):
    """vtc that keeps what it charged per tenant, and what each step computed, counted apart."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.charged: dict[str | None, float] = {}
        self.computed: dict[str | None, float] = {}

    def _charge(self, tenant: str | None, tokens: float) -> None:
        self.charged[tenant] = self.charged.get(tenant, 0.0) + tokens
        super()._charge(tenant, tokens)

    def observe(self, out: SchedulerOutput) -> None:
        for seq, num_new, num_samples in out.scheduled:
            start = seq.num_computed_tokens
            prompt_positions = range(start, min(start + num_new, seq.num_prompt_tokens))
            work = self.input_weight * len(prompt_positions) + self.output_weight * num_samples
            self.computed[seq.request.tenant] = self.computed.get(seq.request.tenant, 0.0) + work
        super().observe(out)


def check_charges(policy: AuditedVTC) -> None:
    tenants = set(policy.charged) | set(policy.computed)
    assert {t: policy.charged.get(t, 0.0) for t in tenants} == {t: policy.computed.get(t, 0.0) for t in tenants}


def test_a_one_token_prompt_is_charged_as_input_and_output():
    s = make_scheduler(AuditedVTC, num_gpu_blocks=64, max_num_seqs=4)
    backend = KVStoreBackend(4)
    a = request("a", 6, max_tokens=8)
    a.tenant = "a"
    s.add(a, now=0.0)
    for step in range(3):  # a's prompt, then decodes
        out = s.schedule(float(step))
        backend.execute(out)
        s.update(out, sample_tokens(out, lambda: 7), step + 1.0)
    b = request("b", 1, max_tokens=4, first_token=500)
    b.tenant = "b"
    s.add(b, now=3.0)
    out = s.schedule(3.0)  # a decodes, b's one-token prompt: one token and one sample each
    assert sorted((e.seq.request.request_id, e.num_new_tokens, e.num_samples) for e in out.scheduled) == [
        ("a", 1, 1), ("b", 1, 1)]
    s.update(out, sample_tokens(out, lambda: 7), 4.0)
    assert s.policy.charged["b"] == 1.0 * 1 + 2.0 * 1  # the prompt token as input, the sample as output
    check_charges(s.policy)


@pytest.mark.parametrize("blocks, mode", [("paged", "recompute"), ("paged", "swap"), ("prefix", "recompute")])
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_every_step_is_charged_its_prompt_and_output_tokens(blocks, mode, workload):
    config, specs, seed = copy.deepcopy(workload)
    scheduler, _ = run_workload(AuditedVTC, blocks, mode, config, specs, seed)
    check_charges(scheduler.policy)
    events = scheduler.recorder.events
    if blocks == "paged" and not any(e[1] in ("preempted", "aborted") and e[-1] != "swap" for e in events):
        # No prompt computed twice or in part: each request's prompt once, and every token it generated.
        rows = scheduler.recorder.requests
        want = sum(1.0 * row["prompt_len"] + 2.0 * row["output_len"] for row in rows)
        assert sum(scheduler.policy.charged.values()) == want
    config, specs, _ = copy.deepcopy(workload)
    scheduler = make_scheduler(AuditedVTC, blocks, preemption_mode=mode, **config)
    drive(scheduler, specs, ahead=True)
    check_charges(scheduler.policy)
