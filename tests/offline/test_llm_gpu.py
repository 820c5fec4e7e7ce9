"""`LLM` end to end on a CUDA GPU (Qwen3-0.6B shapes, dummy bf16 weights): greedy agreement with
transformers on the same weights through the whole engine (scheduler, paged KV, CUDA graphs), the
CUDA-graph engine against the eager one, swap preemption through the pinned pool, and a short
throughput smoke over nano-vllm-like requests. Model-level checks are in test_engine_gpu.py.

    python -m pytest -q -m gpu tests/offline/test_llm_gpu.py
"""
from __future__ import annotations

import gc
import random

import pytest
import torch

from engine.device.weights import to_hf_state_dict
from engine.offline.llm import LLM
from policies.request import SamplingParams

pytestmark = pytest.mark.gpu
ARGS = {"max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 4096, "num_gpu_blocks": 4096,
        "swap_space": 1.0}
PROMPT_LENS = [37, 200, 5, 513, 64, 129]
# What decode_kernel "auto" resolves to here: the Gluon TMA kernel on Hopper (compute capability 9.x).
HOPPER_KERNEL = "tma" if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 else "packed"
STEPS = 24


def prompts_of(lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(0, 10_000) for _ in range(n)] for n in lens]


def greedy(n: int = STEPS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def free() -> None:
    """Return the cache memory of engines the caller has deleted."""
    gc.collect()
    torch.cuda.empty_cache()


@torch.no_grad()
def test_llm_greedy_agrees_with_transformers():
    from transformers import AutoModelForCausalLM

    llm = LLM("qwen3-0.6b", **ARGS)  # the default configuration: async scheduling, decode_kernel "auto"
    assert llm.engine.runner.graphs is not None and llm.engine.runner.dtype == torch.bfloat16
    assert llm.engine.args.async_scheduling and llm.engine.runner.decode_kernel == HOPPER_KERNEL
    prompts = prompts_of(PROMPT_LENS, 0)
    outs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    hf = AutoModelForCausalLM.from_config(llm.engine.model_config.to_hf_config(), dtype=torch.bfloat16)
    hf = hf.cuda().eval()
    hf.load_state_dict(to_hf_state_dict(llm.engine.runner.model), strict=True)
    theirs = []  # transformers' argmax at each position, teacher-forced on our tokens
    for p, toks in zip(prompts, ours):
        logits = hf(torch.tensor([p + toks], device="cuda")).logits[0, len(p) - 1:-1].float()
        theirs.append(logits.argmax(-1).tolist())
    assert all(o[0] == t[0] for o, t in zip(ours, theirs))  # prefill: no decode drift yet
    assert agreement(ours, theirs) >= 0.9  # bf16 near-ties may flip a few decode steps
    assert all(len(o.outputs[0].logprobs) == STEPS for o in outs)
    del llm, hf
    free()


def test_cuda_graph_engine_equals_eager_engine():
    prompts = prompts_of(PROMPT_LENS + [3, 90, 700], 1)
    eager = LLM("qwen3-0.6b", enforce_eager=True, **ARGS)
    e_out = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy(), use_tqdm=False)]
    del eager
    free()
    graphed = LLM("qwen3-0.6b", **ARGS)
    g_out = [o.outputs[0].token_ids for o in graphed.generate(prompts, greedy(), use_tqdm=False)]
    assert graphed.engine.runner.graphs.num_replays >= STEPS - 1
    assert all(e[0] == g[0] for e, g in zip(e_out, g_out))
    assert agreement(g_out, e_out) >= 0.9
    del graphed
    free()


def test_swap_preemption_on_gpu_completes_and_agrees():
    prompts = prompts_of([300] * 12, 2)
    ref = LLM("qwen3-0.6b", **ARGS)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy(64), use_tqdm=False)]
    del ref
    free()
    # 12 x 364 tokens need 12 x 23 blocks of 16; 64 blocks (one 1024-token request) force swaps.
    small = LLM("qwen3-0.6b", **(ARGS | {"max_model_len": 1024, "num_gpu_blocks": 64}),
                preemption_mode="swap")
    outs = small.generate(prompts, greedy(64), use_tqdm=False)
    steps = small.engine.recorder.steps
    assert sum(s["num_preempted_swap"] for s in steps) > 0 and sum(s["num_swap_in_blocks"] for s in steps) > 0
    assert agreement([o.outputs[0].token_ids for o in outs], expected) >= 0.9
    del small
    free()


def test_async_scheduling_feeds_tokens_on_the_device():
    """Scheduled ahead, each decode's input token comes from the step before it on the device. All
    prompts fit one prefill step, so both loops run the same batches: the tokens must be identical.
    Then temperature sampling and swap preemption under async scheduling."""
    prompts = prompts_of(PROMPT_LENS, 3)
    sync = LLM("qwen3-0.6b", async_scheduling=False, **ARGS)
    expected = [o.outputs[0].token_ids for o in sync.generate(prompts, greedy(), use_tqdm=False)]
    del sync
    free()
    llm = LLM("qwen3-0.6b", **ARGS)  # async scheduling: the default
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    assert got == expected
    assert llm.engine.scheduler.num_scheduled_ahead >= STEPS - 2
    params = [SamplingParams(temperature=0.8, ignore_eos=True, max_tokens=n) for n in (5, 40, 17, 64, 1, 33)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert all(0 <= t < llm.engine.vocab_size for o in outs for t in o.outputs[0].token_ids)
    del llm
    free()
    small = LLM("qwen3-0.6b", **(ARGS | {"max_model_len": 1024, "num_gpu_blocks": 64}), preemption_mode="swap",
                async_scheduling=True)
    outs = small.generate(prompts_of([300] * 12, 2), greedy(64), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    steps = small.engine.recorder.steps
    assert sum(s["num_preempted_swap"] for s in steps) > 0 and small.engine.scheduler.num_scheduled_ahead > 0
    assert small.engine.scheduler.block_manager.usage().gpu_used == 0
    del small
    free()


def test_default_engine_agrees_with_the_old_defaults():
    """The default engine (async scheduling, the Gluon TMA kernel on Hopper) against the old defaults
    (synchronous, packed kernel): the same greedy tokens up to bf16 near-ties."""
    prompts = prompts_of(PROMPT_LENS + [3, 90, 700], 4)
    old = LLM("qwen3-0.6b", async_scheduling=False, decode_kernel="packed", **ARGS)
    expected = [o.outputs[0].token_ids for o in old.generate(prompts, greedy(), use_tqdm=False)]
    del old
    free()
    new = LLM("qwen3-0.6b", **ARGS)
    assert new.engine.runner.decode_kernel == HOPPER_KERNEL
    got = [o.outputs[0].token_ids for o in new.generate(prompts, greedy(), use_tqdm=False)]
    assert all(g[0] == e[0] for g, e in zip(got, expected))  # prefill: the same kernel
    assert agreement(got, expected) >= 0.9
    del new
    free()


def test_throughput_smoke():
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10_000) for _ in range(rng.randint(100, 512))] for _ in range(64)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(16, 128))
              for _ in range(64)]
    llm = LLM("qwen3-0.6b", **ARGS)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert all(o.metrics.ttft is not None and o.metrics.ttft >= 0 for o in outs)
    assert llm.engine.runner.graphs.num_replays > 0
    assert llm.engine.scheduler.block_manager.usage().gpu_used == 0
    del llm
    free()


def test_a_dropped_gpu_engine_gives_its_memory_back_without_the_cyclic_collector():
    """LLMEngine freezes the GC heap at start-up, so a CUDA-graph engine (torch.compile'd, graphs
    captured) that is dropped must free its KV cache and weights by reference counting alone."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    llm = LLM("qwen3-0.6b", **ARGS)
    llm.generate(prompts_of([40], 3), greedy(4), use_tqdm=False)
    assert torch.cuda.memory_allocated() > before + 2**30  # weights and KV cache
    collecting = gc.isenabled()
    gc.disable()
    try:
        del llm
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before < 64 * 2**20
    finally:
        if collecting:
            gc.enable()
