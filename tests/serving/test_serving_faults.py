"""Faults of the OpenAI-compatible server, each with its bounded check (the tiny Qwen3 of
tests/serving/test_serving_http.py, uvicorn on 127.0.0.1, the official `openai` client where it fits):

- one request whose handling raises in the engine ends alone with an error; the others are served,
  /health stays OK, no block leaks;
- bodies over the cap get 413 at once (declared or chunked); long text is tokenized off the event
  loop, so /health answers while it tokenizes;
- `--api-key`: /v1/* needs the bearer key, /health and /metrics stay open;
- error bodies are short: no traceback, no exception text of an unexpected error;
- harmless OpenAI fields are accepted; usage reports the prefix cache's hits; several served names;
- `python -m engine.serve`: bad values are one line and exit 2; SIGTERM / Ctrl-C with open streams
  end each with an error event and [DONE], quietly and at once.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")

from test_serving_http import (
    MODEL,
    TEMPLATE,
    _free_port,
    assert_idle,
    engine_args,
)

from engine import serve
from engine.offline.llm_engine import LLMEngine
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.serving.app import OFFLOAD_CHARS, build_app
from engine.serving.guards import API_KEY_ENV, api_keys_from
from engine.serving.server import ServerThread
from policies.request import SamplingParams

POISON = 77  # a prompt starting with this token makes the patched detokenizer raise mid-request


def poison_detokenizer(monkeypatch, llm_engine: LLMEngine) -> None:
    detok = llm_engine.detokenizer
    update = detok.update

    def update_or_raise(state, token_ids, *args, **kwargs):
        if token_ids[0] == POISON and len(token_ids) > 5:  # a few tokens out: mid-stream
            raise RuntimeError("boom in the detokenizer")
        return update(state, token_ids, *args, **kwargs)

    monkeypatch.setattr(detok, "update", update_or_raise)


@pytest.fixture
def served(model_dir):
    llm_engine = LLMEngine(engine_args(model_dir, block_manager="prefix"))
    with ServerThread(build_app(AsyncLLMEngine(llm_engine), [MODEL, "alias"], TEMPLATE,
                                max_request_body_bytes=200_000)) as srv:
        srv.llm_engine = llm_engine
        yield srv


def test_engine_aborts_only_the_request_that_failed(model_dir, monkeypatch):
    """In LLMEngine itself: the failing request ends with "abort:error" and its error; the others
    finish as they would have."""
    engine = LLMEngine(engine_args(model_dir))
    poison_detokenizer(monkeypatch, engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind="delta")
    for i, prompt in enumerate([[1, 2, 3], [POISON, 2, 3], [4, 5]]):
        engine.add_request(f"r{i}", prompt, params)
    final, deadline = {}, time.monotonic() + 30
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["r1"].outputs[0].finish_reason == "abort:error"
    assert final["r1"].error == "RuntimeError: boom in the detokenizer"
    for rid in ("r0", "r2"):
        assert final[rid].error is None
    assert not engine.output_processor.failed and not engine.output_processor.to_abort


def test_one_failing_request_does_not_stop_the_others(served, monkeypatch):
    """A request whose data makes the engine raise gets an error (a 500 body; an error event and
    [DONE] when streamed) while others stream to the end; /health stays 200 and serving goes on."""
    poison_detokenizer(monkeypatch, served.llm_engine)

    async def main():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0,
                                      timeout=60) as client, httpx.AsyncClient(timeout=60) as http:
            async def good(i):
                out = await client.completions.create(model=MODEL, prompt=[i + 1, 2, 3], max_tokens=12,
                                                      temperature=0, extra_body={"ignore_eos": True})
                return out.usage.completion_tokens

            async def bad_stream():
                body = {"model": MODEL, "prompt": [POISON, 1], "max_tokens": 12, "stream": True}
                async with http.stream("POST", served.url + "/v1/completions", json=body) as resp:
                    return [ln async for ln in resp.aiter_lines() if ln]

            async def bad_whole():
                body = {"model": MODEL, "prompt": [POISON, 2], "max_tokens": 12}
                return await http.post(served.url + "/v1/completions", json=body)

            return await asyncio.gather(bad_stream(), bad_whole(), *(good(i) for i in range(6)))

    events, whole, *goods = asyncio.run(asyncio.wait_for(main(), 60))
    assert goods == [12] * 6
    assert events[-1] == "data: [DONE]" and len(events) > 3  # some chunks, then the error, then [DONE]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "boom in the detokenizer" in error["message"]
    assert whole.status_code == 500 and "boom in the detokenizer" in whole.json()["error"]["message"]
    assert "Traceback" not in whole.text
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=30)
    assert client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=3).usage.completion_tokens == 3
    assert_idle(served)


def test_a_body_over_the_cap_is_413_at_once(served):
    big = json.dumps({"model": MODEL, "prompt": "x" * 5_000_000, "max_tokens": 2})
    start = time.monotonic()
    resp = httpx.post(served.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code == 413 and "200000 bytes" in resp.json()["error"]["message"]
    assert time.monotonic() - start < 10  # refused on its Content-Length, not after tokenizing
    chunks = (big[i:i + 65536].encode() for i in range(0, len(big), 65536))  # no Content-Length
    resp = httpx.post(served.url + "/v1/completions", content=chunks, headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code == 413
    small = {"model": MODEL, "prompt": "y" * 1000, "max_tokens": 2}
    resp = httpx.post(served.url + "/v1/completions", content=(c.encode() for c in [json.dumps(small)]),
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"  # read whole: 1000 tokens > 128


def test_long_text_is_tokenized_off_the_event_loop(served, monkeypatch):
    """A prompt that takes 3 s to tokenize: /health answers meanwhile (it would wait 3 s on the loop)."""
    tokenizer, started = served.llm_engine.tokenizer, threading.Event()
    encode = tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if len(text) > OFFLOAD_CHARS:
            started.set()
            time.sleep(3)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    body = {"model": MODEL, "prompt": "z" * (OFFLOAD_CHARS + 1), "max_tokens": 2}
    slow = threading.Thread(target=httpx.post, args=(served.url + "/v1/completions",),
                            kwargs={"json": body, "timeout": 30})
    slow.start()
    try:
        assert started.wait(10)
        start = time.monotonic()
        assert httpx.get(served.url + "/health", timeout=10).status_code == 200
        assert time.monotonic() - start < 1.5
    finally:
        slow.join(30)


def test_api_key(model_dir, monkeypatch):
    engine = AsyncLLMEngine(LLMEngine(engine_args(model_dir, num_gpu_blocks=32)))
    with ServerThread(build_app(engine, MODEL, api_keys=["sk-right"])) as srv:
        right = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-right", max_retries=0, timeout=30)
        assert right.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2).usage.completion_tokens == 2
        assert [m.id for m in right.models.list().data] == [MODEL]
        wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        missing = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 1})
        assert missing.status_code == 401 and "API key" in missing.json()["error"]["message"]
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_keys_from(None) == ("from-env",) and api_keys_from(["a", "b"]) == ("a", "b")
    monkeypatch.setenv(API_KEY_ENV, "")
    assert api_keys_from(None) == ()


def test_error_bodies_are_short(served, monkeypatch, caplog):
    """An unexpected exception in a route: a short 500, the traceback in the log only."""
    from engine.serving import completions

    def broken(*args, **kwargs):
        raise RuntimeError("secret detail at /home/x/file.py line 3")

    monkeypatch.setattr(completions, "sampling_params", broken)
    resp = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 1})
    assert resp.status_code == 500
    message = resp.json()["error"]["message"]
    assert "secret" not in message and "Traceback" not in message and len(message) < 100


def test_harmless_fields_cached_tokens_and_served_names(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    chat = client.chat.completions.create(model="alias", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, response_format={"type": "text"}, store=False)
    assert chat.model == "alias" and chat.usage.completion_tokens == 2
    prompt = list(range(1, 41))  # 2 full blocks of 16 can come from the prefix cache
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32


CLI_ERRORS = (  # (arguments, what the one line names)
    (["--model", "tiny-llama", "bogus=1"], "bogus"),
    (["--model", "tiny-llama", "num_gpu_blocks=-3"], "num_gpu_blocks=-3"),
    (["--model", "/etc/passwd"], "model='/etc/passwd'"),
    (["--model", "tiny-llama", "max_logprobs=-5"], "max_logprobs=-5"),
    (["--model", "tiny-llama", "--max-request-body-bytes", "0"], "max_request_body_bytes=0"),
    (["--model", "tiny-llama", "max_model_len=99999"], "max_model_len=99999"),
)


@pytest.mark.parametrize(("argv", "named"), CLI_ERRORS, ids=[a[-1] for a, _ in CLI_ERRORS])
def test_serve_bad_values_are_one_line_and_exit_2(argv, named, capsys):
    with pytest.raises(SystemExit) as info:
        serve.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: ") and named in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_served_model_names_parse():
    """vLLM's form (names after the flag); overrides that follow stay overrides."""
    ns = serve.parse_args(["--model", "smollm2-135m", "--served-model-name", "HuggingFaceTB/SmolLM2-135M-Instruct",
                           "smollm2-135m", "num_gpu_blocks=64", "--api-key", "k=="])
    assert ns.served_model_name == ["HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"]
    assert ns.overrides == ["num_gpu_blocks=64"] and ns.api_key == "k=="
    assert serve.engine_args_from(ns).num_gpu_blocks == 64


def _start_server(port: int) -> subprocess.Popen:
    """`python -m engine.serve` (its engine in a core process) in a process group of its own, as a
    terminal runs it: Ctrl-C reaches the server and its core."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--model", "tiny-llama", "--port", str(port),
                             "--log-level", "warning", "num_gpu_blocks=600", "max_model_len=2048"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not start: {proc.communicate(timeout=10)}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_server_ends_open_streams_cleanly(sig):
    """4 open streams, then SIGTERM to the server (or Ctrl-C's SIGINT to its process group): each
    stream ends with an error event and `data: [DONE]`, the server exits without a traceback and
    well within uvicorn's graceful timeout."""
    port = _free_port()
    proc = _start_server(port)
    try:
        async def main():
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                opened = asyncio.Queue()

                async def stream(i):
                    body = {"model": "tiny-llama", "prompt": [i + 1, 2], "max_tokens": 2000, "stream": True,
                            "ignore_eos": True}
                    async with http.stream("POST", "/v1/completions", json=body) as resp:
                        lines = []
                        async for ln in resp.aiter_lines():
                            if ln and not lines:
                                opened.put_nowait(i)
                            if ln:
                                lines.append(ln)
                        return lines

                tasks = [asyncio.ensure_future(stream(i)) for i in range(4)]
                for _ in tasks:
                    await asyncio.wait_for(opened.get(), 60)
                if sig == signal.SIGINT:
                    os.killpg(proc.pid, sig)
                else:
                    os.kill(proc.pid, sig)
                return time.monotonic(), await asyncio.wait_for(asyncio.gather(*tasks), 30)

        signalled, results = asyncio.run(main())
        proc.wait(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
        _, stderr = proc.communicate(timeout=30)
    for lines in results:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
    assert "Traceback" not in stderr and "CancelledError" not in stderr and "graceful" not in stderr, stderr
    assert took < 5, f"the server took {took:.1f} s to exit"  # uvicorn's graceful timeout is 5 s


def test_core_messages_carry_cached_tokens_and_errors():
    """A request's error and cached-token count cross the core process's pipe."""
    from engine.offline.outputs import CompletionOutput, RequestOutput
    from engine.online.output_wire import pack, unpack

    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", [], "abort:error")], True,
                        num_cached_tokens=16, error="RuntimeError: boom")
    back = unpack(pack(out, True), None, [1, 2])
    assert (back.num_cached_tokens, back.error, back.outputs[0].finish_reason) == (16, "RuntimeError: boom",
                                                                                   "abort:error")


def test_a_core_failure_is_short_for_clients_and_whole_for_the_log():
    from engine.online.engine_core import _failure

    try:
        raise RuntimeError("device lost\nsecond line")
    except RuntimeError as exc:
        failed = _failure(exc)
    assert failed.error == "RuntimeError: device lost" and not failed.bad_input
    assert failed.traceback.startswith("Traceback") and "second line" in failed.traceback
