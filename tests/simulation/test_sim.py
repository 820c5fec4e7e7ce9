"""The SimPy backend with the real scheduler: timing, idling, stop lengths, swap cost, determinism."""
import pytest

from experiments.lib.workloads import build_workload
from policies import Scheduler, SchedulerConfig, TraceRecorder, make_block_manager, make_policy
from policies.outputs import SchedulerOutput
from policies.request import Request, SamplingParams
from sim import LatencyModel, Simulator


class Constant(LatencyModel):
    """Every step with work takes `step` seconds; a swap of n blocks takes n * `per_block`."""

    def __init__(self, step: float = 0.01, per_block: float = 0.0) -> None:
        self.step, self.per_block = step, per_block

    def step_time(self, out: SchedulerOutput) -> float:
        return self.step if out.scheduled or out.copy else 0.0

    def swap_time(self, num_blocks: int) -> float:
        return self.per_block * num_blocks


def scheduler(num_gpu_blocks=1000, mode="recompute", policy="fcfs", num_cpu_blocks=1000, **cfg):
    return Scheduler(SchedulerConfig(**cfg), make_policy(policy, preemption_mode=mode),
                     make_block_manager("paged", 16, num_gpu_blocks, num_cpu_blocks, 0.0, 4096), TraceRecorder())


def request(rid, arrival, prompt_len, max_tokens):
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival)


def test_timing_and_idle_until_next_arrival():
    sched = scheduler()
    reqs = [request("late", 10.0, 8, 2), request("early", 2.0, 8, 4)]
    result = Simulator(sched, Constant(0.01), reqs).run()
    steps = sched.recorder.steps
    # early: prefill at 2.00 (token 1), decodes at 2.01, 2.02, 2.03; late: prefill 10.00, decode 10.01
    assert [round(s["time"], 6) for s in steps] == [2.0, 2.01, 2.02, 2.03, 10.0, 10.01]
    assert result.num_steps == 6 and result.sim_time_s == pytest.approx(10.02)
    rows = {r["request_id"]: r for r in sched.recorder.requests}
    assert rows["early"]["ttft"] == pytest.approx(0.01)
    assert rows["early"]["token_times"] == pytest.approx([2.01, 2.02, 2.03, 2.04])
    assert rows["early"]["output_len"] == 4 and rows["early"]["finish_reason"] == "length"
    assert rows["late"]["finish_time"] == pytest.approx(10.02)


def test_stop_lengths_end_requests_early():
    sched = scheduler()
    reqs = [request("a", 0.0, 5, 10), request("b", 0.0, 5, 10)]
    Simulator(sched, Constant(), reqs, stop_lens={"a": 3}).run()
    rows = {r["request_id"]: r for r in sched.recorder.requests}
    assert (rows["a"]["output_len"], rows["a"]["finish_reason"]) == (3, "stop")
    assert (rows["b"]["output_len"], rows["b"]["finish_reason"]) == (10, "length")


def test_swap_transfers_are_priced():
    # 12 blocks of 16 tokens for 4 requests that grow to 3 blocks each plus: KV runs out, swap mode.
    sched = scheduler(num_gpu_blocks=10, mode="swap", max_num_batched_tokens=4096)
    reqs = [request(str(i), 0.0, 30, 40) for i in range(4)]
    Simulator(sched, Constant(0.01, per_block=1.0), reqs).run()
    swapping = [s for s in sched.recorder.steps if s["num_swap_out_blocks"] or s["num_swap_in_blocks"]]
    assert swapping, "the pool is too small for all four: something must be swapped"
    for s in swapping:
        assert s["duration"] == pytest.approx(0.01 + s["num_swap_out_blocks"] + s["num_swap_in_blocks"])
    assert all(r["status"] == "finished" and r["output_len"] == 40 for r in sched.recorder.requests)


def run_workload(seed):
    cfg = {"kind": "synthetic", "num_requests": 60, "arrival": "poisson", "rate": 200.0, "burstiness": 1.0,
               "prompt_len": {"dist": "uniform", "low": 10, "high": 200}, "output_len": {"dist": "uniform", "low": 1, "high": 60},
               "max_tokens": None, "priority": None, "shared_prefix_len": 0, "vocab_size": 1000}
    w = build_workload(cfg, seed, 1000)
    sched = scheduler(num_gpu_blocks=40, mode="recompute")
    Simulator(sched, Constant(0.003), w.requests, w.stop_lens).run()
    return w, sched.recorder


def test_every_request_ends_and_runs_are_deterministic():
    w, rec = run_workload(0)
    assert len(rec.requests) == 60
    assert {r["request_id"]: r["output_len"] for r in rec.requests} == \
           {r.request_id: n for r, n in zip(w.requests, w.output_lens)}
    assert sum(s["num_preempted_recompute"] for s in rec.steps) > 0  # 40 blocks: memory pressure
    _, again = run_workload(0)
    assert again.requests == rec.requests and again.steps == rec.steps


class Stuck:
    """A scheduler that holds a request but never schedules it."""

    recorder = TraceRecorder()
    num_waiting, num_running, num_swapped = 1, 0, 0

    def add(self, request, now):
        pass

    def has_unfinished(self):
        return True

    def schedule(self, now):
        return SchedulerOutput(now)


def test_a_stuck_scheduler_is_reported_not_spun():
    with pytest.raises(RuntimeError, match="simulation stalled at t=1.000000s"):
        Simulator(Stuck(), Constant(), [request("x", 1.0, 4, 2)]).run()


def test_async_scheduling_admits_one_step_later():
    """With scheduler.async_scheduling each step is decided as the one before it starts."""
    reqs = [request("early", 2.0, 8, 6), request("mid", 2.015, 8, 2)]
    runs = {}
    for ahead in (False, True):
        sched = scheduler(async_scheduling=ahead)
        Simulator(sched, Constant(0.01), [Request(r.request_id, r.prompt_token_ids, r.sampling_params,
                                                  r.arrival_time) for r in reqs]).run()
        runs[ahead] = {r["request_id"]: r for r in sched.recorder.requests}
    sync, ahead = runs[False], runs[True]
    # sync: mid arrives during the decode step 2.01-2.02 and is admitted at 2.02 (first token 2.03);
    # ahead: the step from 2.02 was decided at 2.01, so mid is admitted at 2.03 (first token 2.04).
    assert sync["mid"]["first_token_time"] == pytest.approx(2.03)
    assert ahead["mid"]["first_token_time"] == pytest.approx(2.04)
    for rid in ("early", "mid"):
        assert ahead[rid]["output_len"] == sync[rid]["output_len"]
        assert ahead[rid]["finish_reason"] == sync[rid]["finish_reason"] == "length"
    assert ahead["early"]["token_times"] == pytest.approx(sync["early"]["token_times"])


def test_async_scheduling_with_forced_lengths_and_pressure_ends_every_request():
    reqs = [request(f"r{i}", 0.002 * i, 20 + (37 * i) % 200, 5 + (11 * i) % 90) for i in range(60)]
    stop_lens = {f"r{i}": 3 + (7 * i) % 40 for i in range(0, 60, 2)}
    rows = {}
    for ahead in (False, True):
        sched = scheduler(num_gpu_blocks=60, mode="swap", num_cpu_blocks=200, async_scheduling=ahead)
        Simulator(sched, Constant(0.01, 1e-4), reqs, stop_lens=stop_lens).run()
        sched.check_invariants()
        rows[ahead] = {r["request_id"]: (r["output_len"], r["finish_reason"]) for r in sched.recorder.requests}
        assert sched.block_manager.usage().gpu_used == 0
        assert sum(s["num_preempted_swap"] for s in sched.recorder.steps) > 0
    assert rows[True] == rows[False] and len(rows[True]) == 60


def test_async_steps_are_priced_before_they_are_looked_past():
    """schedule_ahead applies a step's progress while it runs; the latency model must see the step
    as scheduled (a prompt's chunk over no prefix), not as advanced (over a prefix of itself)."""
    from sim.latency.base import BatchShape

    class Recording(Constant):
        def __init__(self):
            super().__init__(0.01)
            self.chunks = []

        def step_time(self, out):
            self.chunks += BatchShape.of(out).prefill_chunks
            return super().step_time(out)

    reqs = [request("a", 0.0, 40, 20), request("b", 0.035, 30, 5), request("c", 0.07, 50, 5)]
    for ahead in (False, True):
        sched, latency = scheduler(async_scheduling=ahead), Recording()
        Simulator(sched, latency, reqs).run()
        assert sorted(latency.chunks) == [(30, 0), (40, 0), (50, 0)]
        assert (sched.num_scheduled_ahead > 0) is ahead


def test_async_scheduling_stays_synchronous_after_full_sampler_steps():
    """As in the engine, a step with a sequence that needs the full sampler (here top_p < 1) is not
    looked past: a workload of such requests is simulated step by step, a mixed one in part."""
    def run(top_ps):
        reqs = [Request(f"r{i}", list(range(20)), SamplingParams(max_tokens=8, ignore_eos=True, top_p=p),
                        arrival_time=0.03 * i) for i, p in enumerate(top_ps)]
        sched = scheduler(async_scheduling=True)
        Simulator(sched, Constant(0.01), reqs).run()
        assert all(r["finish_reason"] == "length" for r in sched.recorder.requests)
        return sched.num_scheduled_ahead

    assert run([0.9, 0.9, 0.9]) == 0
    assert 0 < run([0.9, 1.0, 1.0]) < run([1.0, 1.0, 1.0])


class Admitting(Constant):
    """`Constant` with a host cost per admitted request (the engine's add_request)."""

    def __init__(self, step: float, admission_s: float) -> None:
        super().__init__(step)
        self.admission_s = admission_s


@pytest.mark.parametrize("fast_forward", [False, True])
def test_a_burst_is_admitted_one_request_after_another_before_the_first_step(fast_forward):
    """The engine's serving loop adds every arrived request before its next step: a burst of 5 at
    t = 0 starts at 5 x admission_s, and a later arrival is seen admission_s after it arrives."""
    sched = scheduler()
    reqs = [request(f"b{i}", 0.0, 8, 2) for i in range(5)] + [request("late", 1.0, 8, 2)]
    Simulator(sched, Admitting(0.01, 0.002), reqs, fast_forward=fast_forward).run()
    steps = sched.recorder.steps
    assert steps[0]["time"] == pytest.approx(0.010) and steps[0]["num_prefill_seqs"] == 5
    rows = {r["request_id"]: r for r in sched.recorder.requests}
    # queued during the admission, prefilled 0.010-0.020, decoded 0.020-0.030
    assert rows["b0"]["ttft"] == pytest.approx(0.020) and rows["b0"]["finish_time"] == pytest.approx(0.030)
    assert rows["late"]["ttft"] == pytest.approx(0.002 + 0.01)  # TTFT still counts from the arrival
    arrived = [e[0] for e in sched.recorder.events if e[1] == "arrived"]  # (time, event, ...)
    assert [round(t, 6) for t in arrived] == [0.01] * 5 + [1.002]


def test_no_admission_cost_leaves_arrivals_as_they_come():
    sched = scheduler()
    Simulator(sched, Admitting(0.01, 0.0), [request(f"b{i}", 0.0, 8, 2) for i in range(3)]).run()
    assert sched.recorder.steps[0]["time"] == 0.0
