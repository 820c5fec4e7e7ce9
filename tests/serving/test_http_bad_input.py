"""Bad request bodies to the HTTP server whose errors need the model's facts or more than a field's
type: each gets a 400 whose message names the field (and the prompt's index where there are
several), the value and what is allowed, and the server serves the next request. Uvicorn on
127.0.0.1 at a free port (a background thread of this process), the shared tiny Qwen3 (vocabulary
of 256), driven by httpx and the official `openai` client, every call with a timeout."""
from __future__ import annotations

import asyncio

import pytest
from optional_deps import require_serving

httpx = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")
require_serving()

from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.serving.app import ServingContext, build_app
from engine.serving.errors import APIError
from engine.serving.server import ServerThread

MODEL = "tiny"
VOCAB = 256
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def server(model_dir):
    llm_engine = LLMEngine(EngineArgs(model=model_dir, num_gpu_blocks=64, swap_space=0.01, max_model_len=128))
    with ServerThread(build_app(AsyncLLMEngine(llm_engine), MODEL)) as srv:
        srv.llm_engine = llm_engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)


def post_completion(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, **body},
                      timeout=TIMEOUT_S)


def assert_serves_on(server, client):
    """A good request after the bad one is served, and the bad one left nothing in the engine."""
    good = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, temperature=0)
    assert good.choices[0].finish_reason == "length" and good.usage.completion_tokens == 3
    assert not server.llm_engine.has_unfinished_requests()


STOP_IDS = (  # (id, stop_token_ids, the ids the message names)
    ("vocab-size", [VOCAB], "[256]"),
    ("huge", [10**9], "[1000000000]"),
    ("some-of-several", [3, 300, 7], "[300]"),
)


@pytest.mark.parametrize(("ids", "named"), [r[1:] for r in STOP_IDS], ids=[r[0] for r in STOP_IDS])
def test_a_stop_token_id_outside_the_vocabulary_is_a_400(server, client, ids, named):
    resp = post_completion(server, prompt=[1, 2, 3], stop_token_ids=ids)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "stop_token_ids", error
    assert error["message"].startswith(f"stop_token_ids={named} is invalid: token ids must be integers in "
                                       f"[0, {VOCAB})"), error
    with pytest.raises(openai.BadRequestError, match=r"stop_token_ids"):
        client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, extra_body={"stop_token_ids": ids})
    assert_serves_on(server, client)


def test_a_negative_stop_token_id_is_a_400(server, client):
    resp = post_completion(server, prompt=[1, 2, 3], stop_token_ids=[-1])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop_token_ids", resp.text
    assert_serves_on(server, client)


def test_a_stop_token_id_in_the_vocabulary_stops(server, client):
    first = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1, temperature=0,
                                      extra_body={"return_token_ids": True}).choices[0].token_ids[0]
    out = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, temperature=0,
                                    extra_body={"stop_token_ids": [first], "return_token_ids": True})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].token_ids == [first]


PROMPTS = (  # (id, prompt, the message's start)
    # the tiny model's byte tokenizer adds no BOS: "" encodes to no tokens
    ("empty-text", "", "prompt='' is invalid: the text encodes to no tokens"),
    ("empty-text-in-a-list", ["hi", ""], "prompt[1]='' is invalid: the text encodes to no tokens"),
    ("empty-text-first", ["", "hi"], "prompt[0]='' is invalid: the text encodes to no tokens"),
    ("empty-ids-in-a-list", [[1, 2], []], "prompt[1]=[] is invalid: a prompt needs at least one token"),
    ("fraction-in-ids", [1, 2.5], "prompt[1]=2.5 is invalid: token ids must be integers"),
    ("whole-float-in-ids", [1, 2.0], "prompt[1]=2.0 is invalid: token ids must be integers"),
    ("bool-in-ids", [1, True], "prompt[1]=True is invalid: token ids must be integers"),
    ("fraction-in-a-list-of-ids", [[1, 2], [3, 4.5]], "prompt[1][1]=4.5 is invalid: token ids must be integers"),
    ("text-in-a-list-of-ids", [[1, 2], [3, "4"]], "prompt[1][1]='4' is invalid: token ids must be integers"),
    ("bool-in-a-list-of-ids", [[True]], "prompt[0][0]=True is invalid: token ids must be integers"),
    ("number-in-a-list-of-texts", ["hi", 3], "prompt[1]=3 is invalid: a list of text prompts holds strings only"),
    ("text-in-a-list-of-id-lists", [[1, 2], "x"], "prompt[1]='x' is invalid: a list of token-id prompts holds"),
    ("out-of-vocabulary-in-a-list", [[1, 2], [3, VOCAB]], "prompt[1]=[256] is invalid: token ids must be integers in"),
    ("too-long-in-a-list", [[1, 2], [3] * 200], "prompt[1] is 200 tokens long: more than this model's max_model_len"),
    ("number", 123, "prompt=123 is invalid: must be a string, a list of token ids, a list of strings or a list of "
                    "token-id lists"),
    ("null", None, "prompt=None is invalid: must be a string"),
    ("null-in-a-list", [None, 1], "prompt[0]=None is invalid: a list prompt holds token ids, strings or token-id "
                                  "lists"),
    ("object-in-a-list", [{"prompt": "hi"}], "prompt[0]={'prompt': 'hi'} is invalid: a list prompt holds"),
)


@pytest.mark.parametrize(("prompt", "says"), [r[1:] for r in PROMPTS], ids=[r[0] for r in PROMPTS])
def test_a_bad_prompt_is_one_specific_message(server, client, prompt, says):
    resp = post_completion(server, prompt=prompt)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith(says), error
    assert ";" not in error["message"] and "Input should be" not in error["message"], error  # not pydantic's pile
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert info.value.body["message"] == error["message"]
    assert_serves_on(server, client)


def test_a_bad_prompt_and_another_bad_field_are_both_named(server):
    error = post_completion(server, prompt=[1, 2.5], temperature="hot").json()["error"]
    assert "prompt[1]=2.5 is invalid" in error["message"] and "temperature" in error["message"], error
    assert error["message"].count("prompt") == 1, error  # the prompt's one message, not one per union member


def test_good_prompt_shapes_still_pass(server, client):
    for prompt in ("hi", [1, 2, 3], [[1, 2], [3, 4]], ["1", "2"]):
        resp = post_completion(server, prompt=prompt, temperature=0)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == (2 if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else 1)
    assert_serves_on(server, client)


class StubTokenizer:
    """Bytes as token ids, after a BOS id where `bos` is given (as Llama 3's tokenizer adds one)."""

    def __init__(self, bos: int | None):
        self.bos = bos

    def encode(self, text: str) -> list[int]:
        return ([self.bos] if self.bos is not None else []) + list(text.encode())


def encode_with(tokenizer, prompt, field_name="prompt"):
    ctx = ServingContext(engine=None, model_names=(MODEL,), max_model_len=128, vocab_size=VOCAB, max_logprobs=5,
                         tokenizer=tokenizer, chat=None, metrics=None)
    try:
        return asyncio.run(ctx.encode(prompt, field_name))
    finally:
        ctx.tokenizer_pool.shutdown()


def test_empty_text_is_served_where_the_tokenizer_adds_bos():
    assert encode_with(StubTokenizer(bos=1), "") == [1]
    assert encode_with(StubTokenizer(bos=1), "", "prompt[1]") == [1]


def test_empty_text_is_refused_where_it_encodes_to_no_tokens():
    for field_name in ("prompt", "prompt[1]"):
        with pytest.raises(APIError) as info:
            encode_with(StubTokenizer(bos=None), "", field_name)
        assert info.value.status == 400 and info.value.param == "prompt", vars(info.value)
        assert info.value.message == f"{field_name}='' is invalid: the text encodes to no tokens"
