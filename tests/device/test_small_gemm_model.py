"""`small_gemm="splitk"` (engine/models/small_gemm.py): which layers it changes, the logits it
gives against the default cuBLAS/torch path (CPU, the kernel interpreted), and how it is refused."""
import dataclasses

import pytest
import torch
from test_engine_model import bind_fresh_cache, run_chunks

import kernels.reference as ref
from engine.device.weights import build_model
from engine.engine_args import EngineArgs
from engine.model_loader import load_model_config
from engine.models.small_gemm import SplitKLinear, use_small_gemm
from engine.offline.llm import LLM
from policies.request import SamplingParams
from tests.engine_model_helpers import BlockAllocator, make_seqs, random_prompts

BLOCK = 4


def _model():
    """tiny-qwen3 with K long enough to split: o_proj 512 -> 64, down_proj 1024 -> 64."""
    cfg = dataclasses.replace(load_model_config("tiny-qwen3"), head_dim=128, intermediate_size=1024)
    model = build_model(cfg, ref, "cpu", torch.float32, seed=1)
    bind_fresh_cache(model)
    return cfg, model


def test_splitk_changes_the_small_n_layers_only():
    _, model = _model()
    assert use_small_gemm(model, "splitk") == 2 * len(model.layers)
    changed = {name.split(".", 2)[-1] for name, m in model.named_modules() if isinstance(m, SplitKLinear)}
    assert changed == {"self_attn.o_proj", "mlp.down_proj"}  # qkv, gate_up and the LM head keep F.linear
    _, plain = _model()
    assert use_small_gemm(plain, "torch") == 0
    assert not any(isinstance(m, SplitKLinear) for m in plain.modules())


@pytest.mark.parametrize("chunk", [1000, 3])
def test_splitk_logits_match_the_torch_path(chunk):
    """Whole and chunked prefill, then decode rows mixed in: the same logits as F.linear's."""
    cfg, torch_model = _model()
    _, splitk_model = _model()
    use_small_gemm(splitk_model, "splitk")
    prompts = random_prompts([7, 13, 1, 22], cfg.vocab_size, seed=2)
    want = run_chunks(torch_model, make_seqs(prompts, SamplingParams()), BlockAllocator(BLOCK, 96), chunk)
    got = run_chunks(splitk_model, make_seqs(prompts, SamplingParams()), BlockAllocator(BLOCK, 96), chunk)
    for seq_id, logits in want.items():
        torch.testing.assert_close(got[seq_id], logits, atol=1e-4, rtol=1e-4)


def test_llm_takes_the_option_to_its_model():
    llm = LLM("tiny-qwen3", small_gemm="splitk", num_gpu_blocks=32, swap_space=0, max_model_len=64)
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.mlp.down_proj, SplitKLinear) and isinstance(layer.self_attn.o_proj, SplitKLinear)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_bad_values_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match=r"small_gemm='cutlass' is invalid: choose one of \('torch', 'splitk'\)"):
        EngineArgs(small_gemm="cutlass")
    _, model = _model()
    with pytest.raises(ValueError, match=r"small_gemm='cutlass' is invalid"):
        use_small_gemm(model, "cutlass")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"small_gemm='splitk' is invalid on cpu: the Triton kernel needs CUDA"):
        use_small_gemm(model, "splitk")
