"""Golden tests: our engine's greedy tokens equal transformers' `generate` on the same tiny random
Llama / Qwen2 / Qwen3 checkpoints (CPU, fp32), also through chunked prefill, prefix-cache hits and
preemption by swap and by recompute; seeded sampling is reproducible; n > 1 shares prompt blocks."""
from __future__ import annotations

import itertools

import pytest
from engine_helpers import hf_greedy, ragged_prompts, save_tiny_model, scheduling

from engine.device import model_runner
from engine.offline.llm import LLM
from policies.request import SamplingParams

ARCHS = ("llama", "qwen2", "qwen3")
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (str(root / arch), save_tiny_model(root / arch, arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(8, seed=1)


@pytest.fixture(scope="module")
def expected(models, prompts):
    return {arch: hf_greedy(model, prompts, MAX_TOKENS) for arch, (_, model) in models.items()}


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _trace_total(llm: LLM, column: str) -> int:
    return sum(row[column] for row in llm.engine.recorder.steps)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "default"])
def test_greedy_matches_transformers(models, prompts, expected, arch, ahead):
    llm = LLM(models[arch][0], num_gpu_blocks=128, swap_space=0.01, max_model_len=256, **scheduling(ahead))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected[arch]
    if ahead:  # steps were scheduled ahead: the trace's step times tile the run without overlap
        assert llm.engine.scheduler.num_scheduled_ahead >= MAX_TOKENS - 2
        steps = llm.engine.recorder.steps
        assert all(a["time"] + a["duration"] <= b["time"] + 1e-9 for a, b in itertools.pairwise(steps))
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert [o.prompt_token_ids for o in outputs] == prompts


@pytest.mark.parametrize("kernel", ["auto", "tma"])
def test_default_engine_with_interpreted_kernels_matches_transformers(models, prompts, expected, kernel, monkeypatch):
    """The default configuration (async scheduling, decode_kernel "auto") with the Triton kernels
    interpreted on the CPU instead of the references: "auto" resolves to the packed kernel here, and
    "tma" runs the per-head kernel (Gluon has no interpreter; kernels/decode.py)."""
    real = model_runner.attention_ops
    monkeypatch.setattr(model_runner, "attention_ops", lambda backend, device, name: real("triton", device, name))
    llm = LLM(models["qwen3"][0], num_gpu_blocks=128, swap_space=0.01, max_model_len=256, decode_kernel=kernel)
    assert llm.engine.args.async_scheduling
    assert llm.engine.runner.decode_kernel == ("packed" if kernel == "auto" else "tma")
    few = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts[:4], few, use_tqdm=False)
    assert _tokens(outputs) == [e[:8] for e in expected["qwen3"][:4]]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "default"])
def test_chunked_prefill_matches_transformers(models, prompts, expected, arch, ahead):
    llm = LLM(models[arch][0], num_gpu_blocks=128, swap_space=0.01, max_model_len=256,
              max_num_batched_tokens=16, block_size=8, **scheduling(ahead))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected[arch]
    # Prompts up to 60 tokens with a 16-token budget: prefills were split over steps and shared
    # steps with decodes.
    steps = llm.engine.recorder.steps
    assert max(len(p) for p in prompts) > 16
    assert any(s["num_prefill_tokens"] and s["num_decode_seqs"] for s in steps)
    assert all(s["num_batched_tokens"] <= 16 for s in steps)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_match_transformers(models, arch):
    path, model = models[arch]
    shared = ragged_prompts(1, seed=7, min_len=40, max_len=40)[0]
    suffixes = ragged_prompts(4, seed=8, min_len=1, max_len=9)
    prefixed = [shared + s for s in suffixes]
    llm = LLM(path, num_gpu_blocks=128, swap_space=0.01, max_model_len=256, block_manager="prefix",
              block_size=8)
    first = llm.generate(prefixed[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prefixed[1:], GREEDY, use_tqdm=False)
    usage = llm.engine.scheduler.block_manager.usage()
    assert usage.prefix_hits >= 3 * (40 // 8)  # the shared full blocks were reused by the others
    assert _tokens(first + rest) == hf_greedy(model, prefixed, MAX_TOKENS)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "default"])
def test_preemption_matches_transformers(models, prompts, expected, arch, mode, ahead):
    # 8 sequences of up to 84 tokens in blocks of 4 need up to 21 blocks each; 24 blocks hold one
    # max_model_len=96 request, so sequences must be preempted and resumed.
    llm = LLM(models[arch][0], num_gpu_blocks=24, swap_space=0.01, max_model_len=96, block_size=4,
              preemption_mode=mode, **scheduling(ahead))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected[arch]
    if mode == "swap":
        assert _trace_total(llm, "num_preempted_swap") > 0
        assert _trace_total(llm, "num_swap_in_blocks") > 0
    else:
        assert _trace_total(llm, "num_preempted_recompute") > 0
        assert _trace_total(llm, "num_preempted_swap") == 0
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert (llm.engine.scheduler.num_scheduled_ahead > 0) is ahead


def test_seeded_sampling_is_reproducible(models, prompts):
    path = models["qwen3"][0]
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for i in range(len(prompts))]
    llm = LLM(path, num_gpu_blocks=128, swap_space=0.01, max_model_len=256)
    batch_a = _tokens(llm.generate(prompts, params, use_tqdm=False))
    batch_b = _tokens(LLM(path, num_gpu_blocks=128, swap_space=0.01, max_model_len=256, block_size=8)
                      .generate(prompts, params, use_tqdm=False))
    alone = _tokens(llm.generate(prompts[3], params[3], use_tqdm=False))
    assert batch_a == batch_b
    assert alone[0] == batch_a[3]  # a seeded request does not depend on its batch
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=999, max_tokens=MAX_TOKENS,
                                ignore_eos=True)
    assert _tokens(llm.generate(prompts[3], other_seed, use_tqdm=False))[0] != batch_a[3]


def test_parallel_samples_share_prompt_blocks(models):
    path = models["llama"][0]
    llm = LLM(path, num_gpu_blocks=64, swap_space=0.01, max_model_len=256, block_size=8)
    engine = llm.engine
    prompt = ragged_prompts(1, seed=3, min_len=32, max_len=32)[0]  # 4 full blocks
    engine.add_request("par", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6,
                                                     ignore_eos=True))
    seqs = engine.scheduler.sequences("par")
    engine.step()  # prefill, 3 samples, fork
    assert len(seqs) == 3
    tables = [s.block_table for s in seqs]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]  # the prompt's blocks, shared
    blocks = engine.scheduler.block_manager
    assert blocks.usage().gpu_used == 4  # one copy of the prompt for three sequences
    engine.step()  # each sample's first output token gets a block of its own
    assert blocks.usage().gpu_used == 4 + 3
    assert seqs[0].block_table[:4] == seqs[1].block_table[:4] == seqs[2].block_table[:4]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = [o for o in outputs if o.finished]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert blocks.usage().gpu_used == 0
