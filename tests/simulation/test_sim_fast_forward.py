"""The simulator's fast-forward over decode runs leaves exactly the traces of stepping one by one.

Property test: random small workloads (arrival ties with step ends, parallel sampling, stop tokens
equal to the simulator's token, min_tokens, forced output lengths, tiny KV pools that preempt)
through every registered policy (requests with tenants) x block manager x preemption mode, chunked prefill and async scheduling on and off, with the
roofline model (which prices re-reads of shared KV blocks below fresh reads), the profiled models
(one of them pricing shared re-reads too) and a dyadic model whose step ends often coincide exactly
with arrivals. Both paths must give equal request rows, step rows, events, clock and final block
pools. Plus: the fast path does cover most steps, the written trace files are byte-identical, and
the scheduler refuses a fast-forward it did not allow.
"""
from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from property_settings import examples

from policies import (
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    TraceRecorder,
    make_block_manager,
    make_policy,
)
from policies.blocks import BLOCK_MANAGERS
from policies.outputs import SchedulerOutput
from policies.policy import available_policies
from policies.trace import STEP_COLUMNS
from sim import SIM_TOKEN, Hardware, LatencyModel, ModelShape, ProfiledModel, RooflineModel, Simulator
from sim.latency.base import BatchShape, shape_decode_times

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 160


class Dyadic(LatencyModel):
    """Step times in 1/1024 s: sums stay exact, so steps end exactly at arrival times often."""

    name = "dyadic"

    def __init__(self, ahead: bool = False) -> None:
        self.ahead = ahead  # scheduling ahead: steps not scheduled ahead cost 1/1024 s more (host work)

    def shape_time(self, b: BatchShape, sync: bool = False) -> float:
        return (8 + b.num_prefill_tokens // 8 + b.num_decode_seqs + b.num_context_tokens // 64 + b.num_copies
                + sync) / 1024

    def step_time(self, out: SchedulerOutput) -> float:
        return self.shape_time(BatchShape.of(out), not out.ahead) if out.scheduled or out.copy else 0.0

    def decode_times(self, num_seqs, num_context_tokens, num_samples, num_steps):
        # A fast-forwarded run: sync steps, or (scheduling ahead) steps scheduled ahead.
        price = lambda b: self.shape_time(b, not self.ahead)
        return shape_decode_times(price, num_seqs, num_context_tokens, num_samples, num_steps)

    def swap_time(self, num_blocks: int) -> float:
        return num_blocks / 512


def _conf(group: str, name: str) -> dict:
    return yaml.safe_load((ROOT / f"conf/{group}/{name}.yaml").read_text())


@functools.cache
def batch_shape_profile() -> Path:
    """example-synthetic.csv with the batch-shape axis: each decode-only row of 2+ sequences at context
    ratio 1 as it is and at ratio 3 1.3x slower, so steps are priced from their longest context."""
    src = (ROOT / "experiments/profiles/example-synthetic.csv").read_text().splitlines()
    header = next(i for i, line in enumerate(src) if line.startswith("kind,"))
    lines = [*src[:header], src[header] + ",context_ratio"]
    for line in src[header + 1:]:
        kind, p, d, c, n, t = line.split(",")
        if kind == "step" and p == "0" and int(d) >= 2:
            lines += [f"{line},1", f"{kind},{p},{d},{c},{n},{float(t) * 1.3!r},3"]
        else:
            lines.append(line + ",")
    path = Path(tempfile.mkdtemp()) / "batch-shape.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def latency_model(name: str, block_size: int, ahead: bool = False) -> LatencyModel:
    if name == "batch-shape":
        return ProfiledModel(batch_shape_profile(), block_size)
    if name == "roofline":
        return RooflineModel(ModelShape.from_dict(_conf("model", "qwen3-0.6b")),
                             Hardware.from_dict(_conf("hardware", "h200")), block_size)
    if name == "dyadic":
        return Dyadic(ahead)
    if name == "operators":  # the committed CPU operator profile, host costs on the steps not ahead
        from sim.latency.operator_profile import OperatorProfile, find_operator_files
        from sim.latency.operators import OperatorModel
        profile = OperatorProfile.load(find_operator_files(ROOT / "experiments/profiles/operators", "cpu", "float32"))
        return OperatorModel(profile, ModelShape.from_dict(_conf("model", "tiny-qwen3")), block_size,
                             batch_sizes=[1, 2, 4, 8], token_sizes=[16, 32, 64], sync_host_s=1e-4,
                             sync_host_per_seq_s=3e-6, async_scheduling=ahead)
    if name == "shared-reads":  # re-reads of a batch's shared KV blocks priced below fresh reads
        return ProfiledModel(ROOT / "experiments/profiles/h200-qwen3-0.6b.csv", block_size, kv_reread_cost=0.45)
    if name.endswith("-async") and not ahead:
        name = name.removesuffix("-async")  # a profile is taken in the runs' scheduling mode
    return ProfiledModel(ROOT / f"experiments/profiles/{name}.csv", block_size)


@st.composite
def cases(draw):
    chunked = draw(st.booleans())
    block_size = draw(st.sampled_from([1, 4, 16]))
    case = {
        "policy": draw(st.sampled_from(available_policies())),
        "mode": draw(st.sampled_from(["recompute", "swap"])),
        "blocks": draw(st.sampled_from(BLOCK_MANAGERS.names())),
        "block_size": block_size,
        "num_gpu_blocks": max(1, draw(st.sampled_from([40, 120, 200, 400, 4000])) // block_size),
        "num_cpu_blocks": draw(st.sampled_from([0, 64, 1000])) // block_size,
        "watermark": draw(st.sampled_from([0.0, 0.05])),
        "config": SchedulerConfig(max_num_batched_tokens=draw(st.sampled_from([3, 16, 64]) if chunked
                                                              else st.just(MAX_MODEL_LEN)),
                                  max_num_seqs=draw(st.integers(1, 8)), max_model_len=MAX_MODEL_LEN,
                                  enable_chunked_prefill=chunked, async_scheduling=draw(st.booleans())),
        "latency": draw(st.sampled_from(["roofline", "dyadic", "dyadic", "example-synthetic", "h200-qwen3-0.6b",
                                         "h200-qwen3-0.6b-async", "batch-shape", "operators", "shared-reads"])),
        "admission_s": draw(st.sampled_from([0.0, 0.0, 3 / 1024])),  # the host's cost per admitted request
    }
    shared = list(range(500, 500 + MAX_MODEL_LEN))
    requests, stop_lens = [], {}
    for i in range(draw(st.integers(1, 14))):
        prompt_len = draw(st.integers(1, 60))
        common = draw(st.sampled_from([0, prompt_len]))  # identical prefixes: prefix-cache hits
        max_tokens = draw(st.integers(1, 60))
        params = {"n": min(draw(st.sampled_from([1, 1, 2, 3])), case["config"].max_num_seqs), "max_tokens": max_tokens,
                  "min_tokens": draw(st.sampled_from([0, 0, max_tokens // 2])),
                  "top_p": draw(st.sampled_from([1.0, 1.0, 1.0, 0.9])),  # the full sampler: never looked past
                  "ignore_eos": draw(st.booleans()),
                  "stop_token_ids": draw(st.sampled_from([[], [], [SIM_TOKEN]]))}
        prompt = shared[:common] + [2000 + 100 * i + j for j in range(prompt_len - common)]
        requests.append((f"r{i}", prompt, params, draw(st.integers(0, 300)) / 1024,
                         draw(st.integers(0, 2)), draw(st.sampled_from([None, SIM_TOKEN, 7])),
                         draw(st.sampled_from([None, "a", "b"]))))
        if draw(st.integers(0, 3)) == 0:
            stop_lens[f"r{i}"] = draw(st.integers(1, max_tokens))
    case["requests"], case["stop_lens"] = requests, stop_lens
    return case


def simulate(case: dict, fast_forward: bool) -> tuple:
    manager = make_block_manager(case["blocks"], case["block_size"], case["num_gpu_blocks"],
                                 case["num_cpu_blocks"], case["watermark"], MAX_MODEL_LEN)
    policy = make_policy(case["policy"], preemption_mode=case["mode"], **case.get("policy_args", {}))
    scheduler = Scheduler(case["config"], policy, manager, TraceRecorder())
    requests = [Request(rid, list(prompt), SamplingParams(**params), arrival_time=arrival, priority=priority,
                        eos_token_id=eos, tenant=tenant)
                for rid, prompt, params, arrival, priority, eos, tenant in case["requests"]]
    latency = latency_model(case["latency"], case["block_size"], case["config"].async_scheduling)
    latency.admission_s = case.get("admission_s", 0.0)
    result = Simulator(scheduler, latency, requests, case["stop_lens"], fast_forward=fast_forward).run()
    if hasattr(manager, "extents"):  # contiguous: extents, not a block pool
        pools = (manager.extents.starts, manager.extents.ends, manager.gpu_refs)
    else:
        pools = (manager.gpu.free_ids, manager.gpu.ref_counts, list(getattr(manager.gpu, "evictor", [])),
                 getattr(manager.gpu, "hash_to_block", None))
    service = getattr(scheduler.policy, "service", None)  # vtc: what it counted per tenant
    counted = {t: service(t) for t in (None, "a", "b")} if service else None
    return scheduler.recorder, result, pools + (manager.cpu.free_ids, counted)


def _one_token(max_tokens: int) -> dict:
    return {"n": 1, "max_tokens": max_tokens, "min_tokens": 0, "top_p": 1.0, "ignore_eos": False, "stop_token_ids": []}


# vtc: a one-step decode run ends its request while the next two arrive. Stepping, the run's step
# began with nothing waiting, so both tenants come back together and tenant "a" is not lifted to
# the other's counter; a run that skipped that step's refresh lifted it (service 6 instead of 2).
VTC_RUN_SEES_NOTHING_WAITING = {
    "policy": "vtc", "mode": "recompute", "blocks": "paged", "block_size": 1, "num_gpu_blocks": 40,
    "num_cpu_blocks": 0, "watermark": 0.0, "latency": "roofline", "stop_lens": {},
    "config": SchedulerConfig(max_num_batched_tokens=3, max_num_seqs=1, max_model_len=MAX_MODEL_LEN,
                              enable_chunked_prefill=True, async_scheduling=False),
    "requests": [("r0", [2000], _one_token(2), 0.0, 0, None, None),
                 ("r1", [2100], _one_token(1), 2 / 1024, 0, None, None),
                 ("r2", [2200], _one_token(1), 2 / 1024, 0, None, "a")]}

# vtc with shares that are not powers of two: a decode run adds each step's service to the
# counters one step at a time, as stepping does, so the float sums (and ties) come out the same.
VTC_WEIGHTED_RUN_SUMS_AS_STEPPING = {
    "policy": "vtc", "policy_args": {"weights": {"a": 3, "b": 0.7}, "input_weight": 0.1},
    "mode": "recompute", "blocks": "paged", "block_size": 4, "num_gpu_blocks": 100, "num_cpu_blocks": 0,
    "watermark": 0.0, "latency": "roofline", "stop_lens": {},
    "config": SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                              enable_chunked_prefill=True, async_scheduling=False),
    "requests": [(f"r{i}", prompt, dict(_one_token(max_tokens), ignore_eos=True), arrival, 0, None, tenant)
                 for i, (prompt, max_tokens, arrival, tenant) in enumerate(
                     [([2000, 2001], 37, 0.0, "a"), ([2100], 23, 0.0, "b"), ([2200], 5, 0.5, "a"),
                      ([2300], 5, 0.5, "b")])]}

# srpt, async scheduling, swap, one running slot: r1 arrives, swaps r0 out, and ends; r0 (top_p < 1:
# the full sampler) is swapped back in by a step scheduled ahead. That step cannot be looked past,
# so stepping decides the next one synchronously; a run from it priced that one as scheduled ahead.
FULL_SAMPLER_AFTER_A_STEP_AHEAD = {
    "policy": "srpt", "mode": "swap", "blocks": "prefix", "block_size": 1, "num_gpu_blocks": 40,
    "num_cpu_blocks": 64, "watermark": 0.0, "latency": "dyadic", "stop_lens": {},
    "config": SchedulerConfig(max_num_batched_tokens=MAX_MODEL_LEN, max_num_seqs=1, max_model_len=MAX_MODEL_LEN,
                              enable_chunked_prefill=False, async_scheduling=True),
    "requests": [("r0", [2000], dict(_one_token(3), top_p=0.9), 0.0, 0, None, None),
                 ("r1", [2100], _one_token(1), 1 / 1024, 0, None, None)]}


# fcfs, async scheduling: r2 arrives during step 1 of a run and can never fit the pool. The run
# keeps that step and the next (decided before the arrival); the step after them, decided at the
# next one's start, aborts r2, which stepping records in the next step's row (its update comes after).
ABORT_DECIDED_PAST_AN_ARRIVAL = {
    "policy": "fcfs", "mode": "recompute", "blocks": "paged", "block_size": 1, "num_gpu_blocks": 40,
    "num_cpu_blocks": 0, "watermark": 0.0, "latency": "dyadic", "admission_s": 0.0, "stop_lens": {},
    "config": SchedulerConfig(max_num_batched_tokens=MAX_MODEL_LEN, max_num_seqs=2, max_model_len=MAX_MODEL_LEN,
                              enable_chunked_prefill=False, async_scheduling=True),
    "requests": [("r0", [2000], _one_token(4), 0.0, 0, None, None),
                 ("r1", [2100], _one_token(1), 0.0, 0, None, None),
                 ("r2", [2200], _one_token(40), 12 / 1024, 0, None, None)]}


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(case=VTC_RUN_SEES_NOTHING_WAITING)
@example(case=VTC_WEIGHTED_RUN_SUMS_AS_STEPPING)
@example(case=FULL_SAMPLER_AFTER_A_STEP_AHEAD)
@example(case=ABORT_DECIDED_PAST_AN_ARRIVAL)
@example(case={**VTC_WEIGHTED_RUN_SUMS_AS_STEPPING, "latency": "operators"})  # synchronous: host costs in runs
@example(case={**FULL_SAMPLER_AFTER_A_STEP_AHEAD, "latency": "operators"})
def test_fast_forward_leaves_the_traces_of_stepping_one_by_one(case):
    fast, fast_result, fast_pools = simulate(case, fast_forward=True)
    plain, plain_result, plain_pools = simulate(case, fast_forward=False)
    assert fast.requests == plain.requests
    assert fast.events == plain.events
    assert fast.step_columns() == plain.step_columns()  # compact decode runs, unbuilt
    assert fast.steps == plain.steps
    assert fast.step_columns() == {name: [row[name] for row in plain.steps] for name in STEP_COLUMNS}
    assert (fast_result.num_steps, fast_result.sim_time_s) == (plain_result.num_steps, plain_result.sim_time_s)
    assert fast_pools == plain_pools  # the block pools and vtc's counted service per tenant


def _run_dir(tmp_path: Path, fast_forward: bool, overrides: list[str]) -> Path:
    from hydra import compose, initialize_config_module

    from experiments.lib.run_workload import run
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "progress=false", "plots=false", f"backend.fast_forward={str(fast_forward).lower()}", *overrides])
    out = tmp_path / f"ff_{fast_forward}"
    run(cfg, out)
    return out


@pytest.mark.parametrize("overrides", [
    ["workload=poisson", "workload.num_requests=150"],
    ["workload=poisson", "workload.num_requests=150", "scheduler.async_scheduling=true"],
    ["workload=sharegpt", "workload.num_requests=120", "blocks=prefix", "workload.shared_prefix_len=32",
     "blocks.num_gpu_blocks=300", "policy.preemption_mode=swap"],
])
def test_trace_files_are_byte_identical(tmp_path, overrides):
    fast, plain = _run_dir(tmp_path, True, overrides), _run_dir(tmp_path, False, overrides)
    for name in ("requests.parquet", "steps.parquet", "events.parquet"):
        assert (fast / name).read_bytes() == (plain / name).read_bytes(), name
    summaries = [json.loads((d / "summary.json").read_text()) for d in (fast, plain)]
    assert [s["config"]["backend"].pop("fast_forward") for s in summaries] == [True, False]
    for s in summaries:
        assert s["run"].pop("wall_time_s") > 0  # the only measured (not simulated) field
    assert summaries[0] == summaries[1]


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_fast_forward_covers_most_decode_steps(monkeypatch, ahead):
    case = {"policy": "fcfs", "mode": "recompute", "blocks": "paged", "block_size": 16, "num_gpu_blocks": 4000,
            "num_cpu_blocks": 0, "watermark": 0.01,
            "config": SchedulerConfig(max_model_len=MAX_MODEL_LEN, async_scheduling=ahead),
            "latency": "roofline", "stop_lens": {},
            "requests": [(f"r{i}", list(range(10 + i)), {"max_tokens": 100 + 7 * i, "ignore_eos": True},
                          i * 0.05, 0, None, None) for i in range(20)]}
    advanced = []
    original = Scheduler.advance_decodes
    monkeypatch.setattr(Scheduler, "advance_decodes",
                        lambda self, times, *a: advanced.append(len(times) - 1) or original(self, times, *a))
    recorder, result, _ = simulate(case, fast_forward=True)
    assert sum(advanced) > 0.9 * result.num_steps and len(advanced) < 0.1 * result.num_steps
    # Only each request's prefill is stepped: scheduling ahead too, a run's last step may end
    # requests and the steps around an arrival are in runs.
    assert result.num_steps - sum(advanced) <= len(case["requests"])
    assert len(recorder.requests) == 20


def test_advance_decodes_refuses_steps_it_did_not_allow():
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), make_policy("fcfs"),
                          make_block_manager("paged", 4, 64, 0, 0.0, 64), TraceRecorder())
    scheduler.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)), 0.0)
    out = scheduler.schedule(0.0)
    scheduler.update(out, {out.scheduled[0].seq.seq_id: [SIM_TOKEN]}, 1.0)
    with pytest.raises(ValueError, match="decode_run_limit allowed 0"):
        scheduler.advance_decodes([1.0, 2.0], SIM_TOKEN)  # not asked first
    assert scheduler.decode_run_limit(100, SIM_TOKEN) == 4  # 4 more tokens; the last step finishes it
    with pytest.raises(ValueError, match="advance_decodes got 5 steps"):
        scheduler.advance_decodes([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], SIM_TOKEN)
    scheduler.add(Request("b", [1, 2], SamplingParams(max_tokens=2)), 1.0)  # waiting: no longer allowed
    assert scheduler.decode_run_limit(100, SIM_TOKEN) == 0


def test_arrivals_exactly_at_step_ends():
    # Dyadic step times are exact: put arrivals exactly on the ends of decode steps of a first run.
    base = {"policy": "fcfs", "mode": "recompute", "blocks": "paged", "block_size": 4, "num_gpu_blocks": 400,
            "num_cpu_blocks": 0, "watermark": 0.0, "config": SchedulerConfig(max_model_len=MAX_MODEL_LEN),
            "latency": "dyadic", "stop_lens": {},
            "requests": [("a", list(range(8)), {"max_tokens": 60, "ignore_eos": True}, 0.0, 0, None, None)]}
    recorder, _, _ = simulate(base, fast_forward=False)
    ends = [row["time"] + row["duration"] for row in recorder.steps]
    case = dict(base, requests=base["requests"] + [
        (f"b{i}", list(range(5)), {"max_tokens": 9, "ignore_eos": True}, ends[k], 0, None, None)
        for i, k in enumerate((3, 20, 21, 40))])
    fast, fast_result, _ = simulate(case, fast_forward=True)
    plain, plain_result, _ = simulate(case, fast_forward=False)
    assert any(row["time"] in ends[3:] and row["num_prefill_seqs"] for row in plain.steps)  # ties happened
    assert (fast.requests, fast.events, fast.steps) == (plain.requests, plain.events, plain.steps)
    assert fast_result == plain_result


@pytest.mark.parametrize("hardware", ["h200", "a100"])
@pytest.mark.parametrize("attention_efficiency", [0.5, 0.001])  # KV-bound / FLOP-bound attention
def test_decode_times_equal_step_times_bit_for_bit(hardware, attention_efficiency):
    hw = Hardware.from_dict({**_conf("hardware", hardware), "attention_efficiency": attention_efficiency})
    models = [RooflineModel(ModelShape.from_dict(_conf("model", "qwen3-0.6b")), hw, 16),
              ProfiledModel(ROOT / "experiments/profiles/h200-qwen3-0.6b.csv", 16)]
    for model in models:
        for num_seqs, context, samples in ((1, 1, 1), (7, 3001, 7), (256, 256 * 900, 256), (3, 10**6, 3)):
            times = model.decode_times(num_seqs, context, samples, 40)
            assert times == [model.shape_time(BatchShape(0, 0, 0, 0, num_seqs, context + s * num_seqs, samples, 0))
                             for s in range(40)]
