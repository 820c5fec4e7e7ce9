"""Tensor parallelism on CPU (gloo): an engine of N ranks (rank 0 here, workers spawned) gives the
same greedy tokens in float32 as the single-process engine, for tiny Llama, Qwen2 and Qwen3 HF
checkpoints (and dummy weights), through chunked prefill, prefix-cache hits, an n > 1 fork, an
abort, preemption by swap and by recompute, and async scheduling; and the same tempered draws
under one torch seed (the fast path: each rank draws from its vocabulary columns, the ranks
exchange their best) and the same tokens through the full sampler (logprobs: the logits gathered).
One engine per (model, N) serves every scenario (`LLMEngine.reset` with a scheduler built for it),
since starting workers costs seconds."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import ragged_prompts, save_tiny_model

from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from policies.blocks import make_block_manager
from policies.policy import make_policy
from policies.request import SamplingParams
from policies.scheduler import Scheduler, SchedulerConfig

BLOCK = 4
ARGS = {"num_gpu_blocks": 128, "swap_space": 0.01, "max_model_len": 96, "block_size": BLOCK}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# (scheduler knobs, sampling) per scenario; "gpu_blocks" squeezes the KV cache to force preemption.
SCENARIOS = {
    "plain": {},
    "chunked": {"budget": 16},
    "prefix": {"blocks": "prefix"},
    "fork": {"n": 2},
    "abort": {"abort": True},
    "swap": {"gpu_blocks": 24, "mode": "swap"},
    "recompute": {"gpu_blocks": 24, "mode": "recompute"},
    "async": {"ahead": True, "budget": 16},
    "swap-async": {"gpu_blocks": 24, "mode": "swap", "ahead": True},
    "tempered": {"temperature": 0.8},
    "tempered-async": {"temperature": 1.0, "ahead": True, "budget": 16},
    "logprobs": {"logprobs": 2},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    for arch in ("llama", "qwen2", "qwen3"):
        save_tiny_model(root / arch, arch, with_tokenizer=False)
    return root


def one_engine_at_a_time(checkpoints, **extra):
    """Yields (model, N) -> engine (`EngineArgs` with `extra`); one open at a time (a process holds
    one tensor-parallel group), so the cases using it come grouped by (model, N)."""
    current: dict[tuple[str, int], LLMEngine] = {}

    def get(model: str, size: int) -> LLMEngine:
        if (model, size) not in current:
            for engine in current.values():
                engine.close()
            current.clear()
            path = model if model.startswith("tiny-") else str(checkpoints / model)
            current[(model, size)] = LLMEngine(EngineArgs(model=path, tensor_parallel_size=size, **ARGS, **extra))
        return current[(model, size)]

    yield get
    for engine in current.values():
        engine.close()


@pytest.fixture(scope="module")
def engines(checkpoints):
    yield from one_engine_at_a_time(checkpoints)


def _scheduler(knobs: dict):
    def build(num_gpu_blocks: int, num_cpu_blocks: int, max_model_len: int) -> Scheduler:
        config = SchedulerConfig(max_num_batched_tokens=knobs.get("budget", 2048), max_num_seqs=256,
                                 max_model_len=max_model_len, enable_chunked_prefill=True,
                                 async_scheduling=knobs.get("ahead", False))
        blocks = make_block_manager(knobs.get("blocks", "paged"), BLOCK, knobs.get("gpu_blocks", num_gpu_blocks),
                                    num_cpu_blocks, 0.01, max_model_len)
        return Scheduler(config, make_policy("fcfs", preemption_mode=knobs.get("mode", "recompute")), blocks)
    return build


def _prompts(scenario: str) -> list[list[int]]:
    if scenario == "prefix":
        shared = ragged_prompts(1, seed=7, min_len=24, max_len=24)[0]
        return [shared + s for s in ragged_prompts(4, seed=8, min_len=1, max_len=6)]
    return ragged_prompts(6, seed=1, min_len=3, max_len=60)


def run(engine: LLMEngine, scenario: str) -> dict:
    """{request id: token lists of its samples} plus the trace's preemption and prefix counts."""
    knobs = SCENARIOS[scenario]
    engine.reset(build_scheduler=_scheduler(knobs))
    params = SamplingParams(n=knobs.get("n", 1), temperature=knobs.get("temperature", 0.0), max_tokens=12,
                            ignore_eos=True, logprobs=knobs.get("logprobs"))
    torch.manual_seed(0)  # the fast path's draws come from torch's global generator
    outputs = []
    for i, prompt in enumerate(_prompts(scenario)):
        engine.add_request(f"r{i}", prompt, params)
        if scenario == "prefix" and i == 0:  # the first request fills the cache the others hit
            while engine.has_unfinished_requests():
                outputs += engine.step()
    for step in range(10_000):
        if not engine.has_unfinished_requests():
            break
        if knobs.get("abort") and step == 3:
            assert engine.abort_request("r2")
        outputs += engine.step()
    steps = engine.recorder.steps
    return {"tokens": {o.request_id: [c.token_ids for c in o.outputs] for o in outputs},
            "finish": {o.request_id: [c.finish_reason for c in o.outputs] for o in outputs},
            "swapped": sum(s["num_preempted_swap"] for s in steps),
            "recomputed": sum(s["num_preempted_recompute"] for s in steps),
            "prefix_hits": engine.scheduler.block_manager.usage().prefix_hits if knobs.get("blocks") else 0}


@pytest.fixture(scope="module")
def reference(checkpoints):
    """The single-process engine's results per (model, scenario)."""
    engines: dict[str, LLMEngine] = {}

    def get(model: str, scenario: str) -> dict:
        if model not in engines:
            path = model if model.startswith("tiny-") else str(checkpoints / model)
            engines[model] = LLMEngine(EngineArgs(model=path, **ARGS))
        return run(engines[model], scenario)

    return get


CASES = [("llama", 2, s) for s in SCENARIOS] + [("qwen2", 2, s) for s in ("plain", "chunked", "swap", "async")] \
    + [("qwen3", 2, s) for s in ("plain", "prefix", "fork", "recompute")] \
    + [("llama", 4, s) for s in ("plain", "chunked", "swap", "async", "tempered", "logprobs")] \
    + [("tiny-qwen3", 2, "plain")]


@pytest.mark.parametrize(("model", "size", "scenario"), CASES, ids=[f"{m}-tp{n}-{s}" for m, n, s in CASES])
def test_tp_matches_single_process(engines, reference, model, size, scenario):
    got, want = run(engines(model, size), scenario), reference(model, scenario)
    assert got["tokens"] == want["tokens"]
    assert got["finish"] == want["finish"]
    knobs = SCENARIOS[scenario]
    if knobs.get("mode") == "swap":
        assert got["swapped"] > 0
    if knobs.get("mode") == "recompute" and "gpu_blocks" in knobs:
        assert got["recomputed"] > 0
    if scenario == "prefix":
        assert got["prefix_hits"] >= 3 * (24 // BLOCK)
    if scenario == "abort":
        assert got["finish"]["r2"] == ["abort:user"]
    if scenario == "fork":
        assert all(len(samples) == 2 for samples in got["tokens"].values())
    if scenario.startswith("tempered"):  # drawn, not greedy
        assert got["tokens"] != reference(model, "plain")["tokens"]
