"""The engine's model runner on a CUDA GPU: Qwen3-0.6B shapes with dummy bf16 weights against
transformers on the same weights, CUDA-graph steps (decode-only, and prefill chunks mixed with
decodes) against eager steps, the profiled KV budget, and swaps through pinned memory on the side
stream.

Run on the GPU machine (tests/conftest.py compiles the kernels for a `-m gpu` run):
    python -m pytest -q -m gpu tests/device/test_engine_gpu.py
"""
import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import CacheConfig
from engine.device.attention import DEFAULT_DECODE_KERNEL
from engine.device.cuda_graph import StepGraphs
from engine.device.model_runner import ModelRunner
from engine.device.weights import to_hf_state_dict
from engine.model_loader import load_model_config
from policies.outputs import SchedulerOutput
from policies.request import SamplingParams
from tests.engine_model_helpers import BlockAllocator, make_seqs, random_prompts, step

pytestmark = pytest.mark.gpu
PROMPT_LENS = [37, 200, 5, 513, 64]


def qwen3_runner(enforce_eager: bool, compile_model: bool | None = None, dtype: torch.dtype = torch.bfloat16,
                 decode_kernel: str = DEFAULT_DECODE_KERNEL, **cache) -> ModelRunner:
    cfg = load_model_config("qwen3-0.6b")
    cache = CacheConfig(**({"num_gpu_blocks": 2048} | cache))
    return ModelRunner(cfg, cache, max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=2048,
                       device="cuda", dtype=dtype, enforce_eager=enforce_eager, seed=0,
                       compile_model=compile_model, decode_kernel=decode_kernel)


def run_greedy(runner: ModelRunner, prompts: list[list[int]], steps: int,
               forced: list[list[int]] | None = None,
               chunk: int = 10_000) -> tuple[list[list[int]], list[list[dict]]]:
    """Greedy decode of `steps` tokens per prompt with top-5 logprobs, prompts computed `chunk`
    tokens per step (small: prefill chunks share steps with decodes); with `forced`, the sequences
    continue with those tokens instead of their own (teacher forcing), so two runs can be compared
    position by position."""
    seqs = make_seqs(prompts, SamplingParams(temperature=0, logprobs=5, max_tokens=steps))
    alloc = BlockAllocator(runner.block_size, runner.num_gpu_blocks)
    tokens = [[] for _ in seqs]
    logprobs = [[] for _ in seqs]
    while any(len(t) < steps for t in tokens):
        results = step(runner, alloc, [s for s, t in zip(seqs, tokens) if len(t) < steps], chunk)
        for i, s in enumerate(seqs):
            if s.seq_id in results:
                if forced is not None:
                    s.token_ids[-1] = forced[i][len(tokens[i])]
                tokens[i].append(results[s.seq_id].token_ids[0])
                logprobs[i].append(results[s.seq_id].logprobs[0])
    return tokens, logprobs


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    pairs = [(a, b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / len(pairs)


@pytest.mark.parametrize("compile_model, decode_kernel", [(False, "per-head"), (True, "per-head"),
                                                          (True, "packed"), (True, "tma")])
@torch.no_grad()
def test_qwen3_dummy_bf16_close_to_transformers(compile_model, decode_kernel):
    runner = qwen3_runner(enforce_eager=True, compile_model=compile_model, decode_kernel=decode_kernel)
    hf = AutoModelForCausalLM.from_config(runner.model_config.to_hf_config(), dtype=torch.bfloat16)
    hf = hf.cuda().eval()
    hf.load_state_dict(to_hf_state_dict(runner.model), strict=True)
    prompts = random_prompts(PROMPT_LENS, 10_000, seed=0)
    ours, our_lp = run_greedy(runner, prompts, steps=24)
    # transformers teacher-forced on our tokens: its argmax at every generated position
    theirs = []
    for i, (p, toks) in enumerate(zip(prompts, ours)):
        logits = hf(torch.tensor([p + toks], device="cuda")).logits[0].float()
        theirs.append(logits[len(p) - 1:-1].argmax(-1).tolist())
        top = torch.log_softmax(logits[len(p) - 1], -1).topk(5)
        mine = our_lp[i][0]
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            if t in mine:
                assert abs(mine[t] - v) < 0.15, (t, mine[t], v)
    assert agreement(ours, theirs) >= 0.9
    assert all(o[0] == t[0] for o, t in zip(ours, theirs))


@pytest.mark.parametrize("chunk", [10_000, 96])
@torch.no_grad()
def test_cuda_graph_steps_agree_with_eager_steps(chunk):
    """chunk 10_000: one prefill step, then decode-only steps (7 seqs: padded to the 8-graph); chunk
    96: the 513-token prompt prefills in chunks next to the others' decodes (mixed-step graphs with
    idle decode rows and a tile map). The graphs' matmuls have other shapes than the eager steps'
    (padded batches), so bf16 rounding differs from the prefill on: the bar is transformers' (same
    first tokens, >= 0.9 teacher-forced agreement, first-position logprobs within 0.15)."""
    prompts = random_prompts(PROMPT_LENS + [3, 90], 10_000, seed=1)
    eager = qwen3_runner(enforce_eager=True, compile_model=True)  # same ops; only the graphs differ
    e_tok, e_lp = run_greedy(eager, prompts, steps=20, chunk=chunk)
    del eager
    torch.cuda.empty_cache()
    graphed = qwen3_runner(enforce_eager=False)
    assert graphed.graphs is not None and 8 in graphed.graphs.sizes
    g_tok, g_lp = run_greedy(graphed, prompts, steps=20, forced=e_tok, chunk=chunk)
    assert graphed.graphs.num_replays == (20 if chunk == 10_000 else 25)  # every step ran a graph
    assert all(e[0] == g[0] for e, g in zip(e_tok, g_tok))
    assert agreement(g_tok, e_tok) >= 0.9
    for e, g in zip(e_lp, g_lp):
        assert all(abs(e[0][t] - g[0][t]) < 0.15 for t in set(e[0]) & set(g[0]))


@pytest.mark.parametrize("chunk", [10_000, 96])
@torch.no_grad()
def test_cuda_graph_replays_equal_their_shapes_run_eagerly(chunk):
    """The captured graphs against the same padded shapes and buffers run without capture
    (`StepGraphs(capture=False)`, same runner, same kernels): the same tokens and logprobs."""
    prompts = random_prompts(PROMPT_LENS + [3, 90], 10_000, seed=1)
    runner = qwen3_runner(enforce_eager=False)
    g_tok, g_lp = run_greedy(runner, prompts, steps=20, chunk=chunk)
    assert runner.graphs.num_replays == (20 if chunk == 10_000 else 25)
    runner.graphs = StepGraphs(runner.model, runner.batch, max_num_seqs=64, max_num_batched_tokens=2048,
                               width=runner.graphs.width, capture=False)
    s_tok, s_lp = run_greedy(runner, prompts, steps=20, chunk=chunk)
    assert runner.graphs.num_replays == (20 if chunk == 10_000 else 25)
    assert s_tok == g_tok
    worst = max(abs(a[t] - b[t]) for sa, ga in zip(s_lp, g_lp) for a, b in zip(sa, ga) for t in set(a) & set(b))
    assert worst < 1e-3, worst


def test_profiled_kv_budget_respects_gpu_memory_utilization():
    gc.collect()
    torch.cuda.empty_cache()
    runner = qwen3_runner(enforce_eager=True, num_gpu_blocks=None, gpu_memory_utilization=0.3,
                          swap_space=0.5)
    total = torch.cuda.mem_get_info()[1]
    assert runner.num_gpu_blocks > 2048 // 16
    assert torch.cuda.memory_allocated() <= 0.3 * total
    assert runner.num_cpu_blocks == int(0.5 * (1 << 30)) // (16 * 2 * 28 * 8 * 128 * 2)
    assert runner.kv_cache.cpu_k_caches[0].is_pinned()


@torch.no_grad()
def test_swap_roundtrip_through_pinned_pool_on_side_stream():
    runner = qwen3_runner(enforce_eager=True, swap_space=0.25)
    kv = runner.kv_cache
    src = [3, 7, 11]
    for cache in kv.k_caches + kv.v_caches:
        cache[src] = torch.randn_like(cache[src])
    before = [c[src].clone() for c in kv.k_caches + kv.v_caches]
    runner.execute(SchedulerOutput(now=0, swap_out={b: i for i, b in enumerate(src)}))
    for cache in kv.k_caches + kv.v_caches:
        cache[src] = 0
    dst = [100, 5, 64]
    runner.execute(SchedulerOutput(now=0, swap_in={i: b for i, b in enumerate(dst)},
                                   copy=[(100, 200)]))
    for b, c in zip(before, kv.k_caches + kv.v_caches):
        assert torch.equal(c[dst], b)
        assert torch.equal(c[200], b[0])


def _compiled_sampling_kernels() -> int:
    from kernels.sample import _chunk_best_kernel
    return len(_chunk_best_kernel.device_caches[torch.cuda.current_device()][0])


def test_the_fast_sampling_path_is_compiled_at_start_up():
    """The runner's start-up draws once with a temperature: the first tempered step compiles nothing."""
    runner = qwen3_runner(enforce_eager=True)
    compiled = _compiled_sampling_kernels()
    assert compiled >= 1
    prompts = random_prompts([37, 5], runner.vocab_size)
    seqs = make_seqs(prompts, SamplingParams(temperature=1.0, max_tokens=4))
    step(runner, BlockAllocator(16, 2048), seqs, chunk=10_000)
    assert _compiled_sampling_kernels() == compiled
