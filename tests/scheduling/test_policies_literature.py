"""The literature's policies on hand-made cases: sjf / srpt on predicted lengths (and an undeclared
changing key caught), FastServe's skip-join MLFQ, and VTC's fair share with counter lift."""
from __future__ import annotations

import pytest
from scheduler_helpers import KVStoreBackend, make_scheduler, request, run_to_end, sample_tokens

from policies import Scheduler, SchedulerConfig, make_block_manager
from policies.length_predictor import make_predictor
from policies.policy import make_policy
from policies.policy.srpt import ShortestRemainingTimePolicy


def admitted(outs) -> list[str]:
    """Request ids in the order they were first scheduled."""
    seen: list[str] = []
    for out in outs:
        for entry in out.scheduled:
            rid = entry.seq.request.request_id
            if rid not in seen:
                seen.append(rid)
    return seen


def step(s: Scheduler, backend: KVStoreBackend, now: float):
    out = s.schedule(now)
    backend.execute(out)
    s.update(out, sample_tokens(out, lambda: 7), now + 1)
    s.check_invariants()
    return out


def oracle(**lengths):
    return make_predictor("oracle", lengths=lengths)


def test_sjf_serves_the_shortest_predicted_first_and_aging_is_a_static_key():
    s = make_scheduler("sjf", num_gpu_blocks=64, max_num_seqs=1, predictor=oracle(a=9, b=2, c=5))
    for rid in "abc":
        s.add(request(rid, 4, max_tokens=9), now=0.0)
    assert admitted(run_to_end(s)) == ["b", "c", "a"]
    # aging 1 token/s: b (pred 2) arriving 10 s after a (pred 9) is keyed 12 > 9.
    s = make_scheduler("sjf", num_gpu_blocks=64, max_num_seqs=1, predictor=oracle(a=9, b=2), aging=1.0)
    s.add(request("a", 4, max_tokens=9, arrival=0.0), now=0.0)
    s.add(request("b", 4, max_tokens=9, arrival=10.0), now=10.0)
    assert admitted(run_to_end(s, now=10.0)) == ["a", "b"]
    with pytest.raises(ValueError, match="aging=-1"):
        make_policy("sjf", aging=-1)


def test_srpt_preempts_a_longer_remaining_job():
    s = make_scheduler("srpt", num_gpu_blocks=64, max_num_seqs=1, predictor=oracle(long=20, short=2))
    backend = KVStoreBackend(4)
    s.add(request("long", 4, max_tokens=20), now=0.0)
    step(s, backend, 0.0)
    s.add(request("short", 4, max_tokens=2, first_token=300), now=1.0)
    out = step(s, backend, 1.0)
    assert [seq.request.request_id for seq in out.preempted] == ["long"]
    assert [e.seq.request.request_id for e in out.scheduled] == ["short"]
    run_to_end(s, now=2.0, backend=backend)


def chunked_srpt(policy) -> tuple[Scheduler, KVStoreBackend]:
    """r1 (5 tokens left) joins the running queue ahead of r0 (7 left), then prefills in chunks
    (budget 3) while r0 decodes: r0's remaining work falls below r1's, neither moving in the queue."""
    config = SchedulerConfig(max_num_batched_tokens=3, max_num_seqs=4, max_model_len=64)
    s = Scheduler(config, policy, make_block_manager("paged", 4, 64, 0, 0.0, 64))
    backend = KVStoreBackend(4)
    s.add(request("r0", 2, max_tokens=8), now=0.0)
    step(s, backend, 0.0)
    s.add(request("r1", 12, max_tokens=5, first_token=300), now=1.0)
    return s, backend


def test_a_changing_key_must_be_declared():
    class Undeclared(ShortestRemainingTimePolicy):
        reorders = frozenset()

    lengths = oracle(r0=8, r1=5)
    s, backend = chunked_srpt(Undeclared(predictor=lengths, preempt_running=False))
    with pytest.raises(AssertionError, match="running queue is out of policy order"):
        run_to_end(s, now=1.0, backend=backend)
    s, backend = chunked_srpt(ShortestRemainingTimePolicy(predictor=lengths, preempt_running=False))
    run_to_end(s, now=1.0, backend=backend)


def test_mlfq_skip_join_demotion_and_preemption():
    policy = make_policy("mlfq", num_levels=4, base_quantum=2, growth=2.0, prompt_token_cost=1.0)
    s = make_scheduler("mlfq", num_gpu_blocks=64, max_num_seqs=1, num_levels=4, base_quantum=2, growth=2.0,
                       prompt_token_cost=1.0)
    s.add(request("a", 2, max_tokens=10), now=0.0)  # prefill cost 2 <= quantum 2: level 0
    seq = s.sequences("a")[0]
    assert policy.level(seq) == 0
    s.add(request("long-prompt", 7, max_tokens=2, first_token=500), now=0.0)  # 7 > 2, 4 -> level 2 (8)
    assert policy.level(s.sequences("long-prompt")[0]) == 2
    backend = KVStoreBackend(4)
    for now in range(3):  # a runs (level 0), generates 3 tokens: demoted to level 1 after 2
        step(s, backend, float(now))
    assert policy.level(seq) == 1
    s.add(request("b", 2, max_tokens=2, first_token=800), now=3.0)
    out = step(s, backend, 3.0)  # b (level 0) forces a (level 1) out
    assert [q.request.request_id for q in out.preempted] == ["a"]
    run_to_end(s, now=4.0, backend=backend)


def test_vtc_serves_the_least_served_tenant_and_lifts_returning_ones():
    s = make_scheduler("vtc", num_gpu_blocks=256, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
    for i in range(4):
        s.add(dataclass_tenant(request(f"h{i}", 8, max_tokens=4, first_token=100 * i + 100), "heavy"), now=0.0)
    s.add(dataclass_tenant(request("l0", 8, max_tokens=4, first_token=900), "light"), now=0.0)
    order = admitted(run_to_end(s))
    assert order[:3] == ["h0", "l0", "h1"]  # after h0's service, light (counter 0) goes next
    policy = s.policy
    assert (policy.service("heavy"), policy.service("light")) == (4 * (8 + 2 * 4), 8 + 2 * 4)
    # A tenant that comes back after being idle is lifted to the others' level, not left at 0.
    s.add(dataclass_tenant(request("h9", 8, max_tokens=40, first_token=1900), "heavy"), now=100.0)
    s.add(dataclass_tenant(request("h10", 8, max_tokens=4, first_token=2000), "heavy"), now=100.0)
    step(s, KVStoreBackend(4), 100.0)
    s.add(dataclass_tenant(request("new", 8, max_tokens=4, first_token=2100), "newcomer"), now=101.0)
    s.schedule(101.0)
    # heavy kept waiting (h10) while the newcomer arrived: the newcomer starts at heavy's counter.
    assert policy.counters["newcomer"] == policy.counters["heavy"] == 4 * (8 + 2 * 4) + 8 + 2
    with pytest.raises(ValueError, match="weights.x=0"):
        make_policy("vtc", weights={"x": 0})


def dataclass_tenant(req, tenant):
    req.tenant = tenant
    return req
