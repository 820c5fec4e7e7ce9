"""The split-K GEMM on a CUDA GPU in bf16 at the engine's shapes, against float64 and cuBLAS, replayed
from a CUDA graph; and an engine with `small_gemm="splitk"` against the default one.

Run on the GPU machine (tests/conftest.py compiles the kernels for a `-m gpu` run):
    python -m pytest -q -m gpu tests/kernel/test_small_gemm_gpu.py
"""
import pytest
import torch
from test_engine_gpu import PROMPT_LENS, agreement, run_greedy

from engine.config import CacheConfig
from engine.device.model_runner import ModelRunner
from engine.model_loader import load_model_config
from engine.models.small_gemm import SplitKLinear
from kernels.small_gemm import SplitKConfig, new_counters, pick_config, splitk_linear
from tests.engine_model_helpers import random_prompts

pytestmark = pytest.mark.gpu
BF16_MAX_ERR = 1e-2  # relative to float64, as the other kernels' bf16 checks
# (N, K): Qwen3-0.6B o_proj and down; Qwen3-8B o_proj and down at TP=1 and TP=2 (one rank's K);
# one with N and K off the tiles (masked columns, a short last K step).
SHAPES = [(1024, 2048), (1024, 3072), (4096, 4096), (4096, 12288), (4096, 2048), (4096, 6144), (1000, 2000)]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _config(m: int, n: int, k: int) -> SplitKConfig:
    """The engine's config, or a two-way split of its tile where the engine would take cuBLAS."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return pick_config(m, n, k, sms) or pick_config(m, 64, k, sms).with_splits(k, 2)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 64, 176, 250, 512])
@torch.no_grad()
def test_bf16_matches_float64_and_cublas(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=gen).bfloat16()
    counters = new_counters(n, "cuda")
    config = _config(m, n, k)
    out = splitk_linear(x, w, b, counters, config)
    ref = x.double() @ w.double().t() + b.double()
    assert _rel_err(out, ref) < BF16_MAX_ERR
    assert _rel_err(out, torch.nn.functional.linear(x, w, b).double()) < BF16_MAX_ERR
    assert torch.equal(out, splitk_linear(x, w, b, counters, config))  # deterministic sum order
    assert counters.count_nonzero().item() == 0


@torch.no_grad()
def test_graph_replays_reuse_the_counters():
    """Captured once, replayed on new inputs: each replay's result is that input's (the counters
    every launch leaves at zero are the only state between replays)."""
    m, n, k = 176, 1024, 3072
    x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    counters, config = new_counters(n, "cuda"), _config(m, n, k)
    assert config.splits >= 2
    x.normal_()
    splitk_linear(x, w, None, counters, config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = splitk_linear(x, w, None, counters, config)
    for _ in range(3):
        x.normal_()
        graph.replay()
        assert _rel_err(out, x.double() @ w.double().t()) < BF16_MAX_ERR


@torch.no_grad()
def test_engine_with_splitk_agrees_with_the_default():
    """Qwen3-0.6B shapes, dummy bf16 weights, CUDA graphs: the split-K engine teacher-forced on the
    default engine's greedy tokens (the bar of tests/device/test_engine_gpu.py's graph test)."""
    cfg = load_model_config("qwen3-0.6b")
    prompts = random_prompts(PROMPT_LENS + [3, 90], 10_000, seed=1)
    results = []
    for small_gemm in ("torch", "splitk"):
        runner = ModelRunner(cfg, CacheConfig(num_gpu_blocks=2048), max_num_batched_tokens=2048, max_num_seqs=64,
                             max_model_len=2048, device="cuda", dtype=torch.bfloat16, seed=0, small_gemm=small_gemm)
        layers = [m for m in runner.model.modules() if isinstance(m, SplitKLinear)]
        assert len(layers) == (0 if small_gemm == "torch" else 2 * cfg.num_hidden_layers)
        results.append(run_greedy(runner, prompts, steps=20, forced=results[0][0] if results else None))
        runner.close()
    (t_tok, t_lp), (s_tok, s_lp) = results
    assert all(a[0] == b[0] for a, b in zip(t_tok, s_tok))
    assert agreement(s_tok, t_tok) >= 0.9
    for a, b in zip(t_lp, s_lp):
        assert all(abs(a[0][t] - b[0][t]) < 0.15 for t in set(a[0]) & set(b[0]))
