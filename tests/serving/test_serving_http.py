"""The OpenAI-compatible server for real: uvicorn on 127.0.0.1 at a free port (a background thread of
this process), a tiny random Qwen3 with a byte-level tokenizer (HF dir), driven by the official
`openai` client. Greedy outputs equal `LLM.generate` on a second engine over the same weights;
64 concurrent streams of which a third disconnect leave no request and no KV block behind; every
bad request gets its status and a message naming the field, and the server serves on."""
from __future__ import annotations

import asyncio
import json
import random

import pytest
from engine_helpers import ragged_prompts
from optional_deps import require_serving

httpx = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")
require_serving()

from engine.engine_args import EngineArgs
from engine.offline.llm import LLM
from engine.offline.llm_engine import LLMEngine
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.serving.app import build_app
from engine.serving.server import ServerThread
from policies.request import SamplingParams

MODEL = "tiny"
MAX_MODEL_LEN = 128
# A template for the byte tokenizer (it has none): role and content, one line each.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def engine_args(path: str, **kw) -> EngineArgs:
    return EngineArgs(model=path, num_gpu_blocks=kw.pop("num_gpu_blocks", 256), swap_space=0.01,
                      max_model_len=MAX_MODEL_LEN, **kw)


@pytest.fixture(scope="module")
def reference(model_dir):
    """LLM.generate on its own engine over the same weights."""
    return LLM(model_dir, num_gpu_blocks=256, swap_space=0.01, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(model_dir):
    llm_engine = LLMEngine(engine_args(model_dir))
    engine = AsyncLLMEngine(llm_engine)
    ended = {}  # request id -> RequestStats of every request that ended on the server
    engine.add_finished_observer(lambda r: ended.__setitem__(r.request_id, r))
    with ServerThread(build_app(engine, MODEL, TEMPLATE)) as srv:
        srv.llm_engine, srv.ended = llm_engine, ended
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def greedy(reference, prompts, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return reference.generate(prompts, params, use_tqdm=False)


def assert_idle(server):
    """Every request ended and every KV block is free again."""
    engine = server.llm_engine
    assert not engine.has_unfinished_requests()
    bm = engine.scheduler.block_manager
    bm.check_invariants([])
    assert bm.num_free_gpu_blocks() == bm.num_gpu_blocks


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count"):
        assert name in text, name
    count = [ln for ln in text.splitlines() if ln.startswith("vllm:e2e_request_latency_seconds_count")]
    assert float(count[0].split()[-1]) >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_equal_llm_generate(client, reference, stream):
    prompts = ragged_prompts(3, seed=11, max_len=30)
    text_prompt = "The quick brown fox"
    want = greedy(reference, [*prompts, text_prompt], 12)
    got_ids, got_text = [], []
    for prompt in [*prompts, text_prompt]:
        kw = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
              "extra_body": {"return_token_ids": True, "ignore_eos": True}}
        if stream:
            ids, text, reasons, usage = [], "", [], None
            for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    ids += c.token_ids
                    text += c.text
                    reasons.append(c.finish_reason)
            assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
            assert usage.completion_tokens == 12 and usage.prompt_tokens == len(want[len(got_ids)].prompt_token_ids)
        else:
            out = client.completions.create(**kw)
            ids, text = out.choices[0].token_ids, out.choices[0].text
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 12
        got_ids.append(ids)
        got_text.append(text)
    assert got_ids == [w.outputs[0].token_ids for w in want]
    assert got_text[-1] == want[-1].outputs[0].text


def test_completion_with_several_prompts_and_n(client, reference):
    prompts = ragged_prompts(2, seed=12, max_len=20)
    want = greedy(reference, prompts, 5)
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert c.token_ids == want[c.index // 2].outputs[0].token_ids  # greedy: both samples agree
    assert out.usage.completion_tokens == 20
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_user_is_the_tenant(server, client, monkeypatch):
    """The body's `user` (OpenAI's end-user id) is the tenant the engine's requests are added with."""
    engine, tenants = server.llm_engine, []
    add = engine.add_request

    def spy(*args, **kwargs):
        tenants.append(kwargs.get("tenant"))
        return add(*args, **kwargs)
    monkeypatch.setattr(engine, "add_request", spy)
    client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0, user="alice")
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                   temperature=0, user="bob")
    client.completions.create(model=MODEL, prompt=[4, 5], max_tokens=2, temperature=0)
    assert tenants == ["alice", "alice", "bob", None]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equals_llm_generate_on_the_template(client, reference, stream):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    tok = reference.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    want = greedy(reference, [ids], 10)[0].outputs[0]
    kw = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    if stream:
        roles, text, reasons = [], "", []
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                roles.append(c.delta.role)
                text += c.delta.content or ""
                reasons.append(c.finish_reason)
        assert roles[0] == "assistant" and reasons[-1] == "length"
    else:
        out = client.chat.completions.create(**kw)
        text = out.choices[0].message.content
        assert out.choices[0].message.role == "assistant" and out.usage.prompt_tokens == len(ids)
    assert text == want.text


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(top) >= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and all(len(t.top_logprobs) == 3 for t in content)


def test_concurrent_streams_with_disconnects(server, reference):
    """64 streaming clients at once; a random third hang up after a few chunks. Those requests are
    aborted on the server (before their last token), every block is freed, and every other request
    gets exactly LLM.generate's tokens."""
    rng = random.Random(0)
    prompts = ragged_prompts(64, seed=13, max_len=24)
    max_tokens = 24
    want = greedy(reference, prompts, max_tokens)
    quitters = set(rng.sample(range(64), 64 // 3))

    results = asyncio.run(streams_with_disconnects(server.url, prompts, max_tokens, quitters))
    for i, _, ids in results:
        if i not in quitters:
            assert ids == want[i].outputs[0].token_ids, i
    # The server notices each hang-up within a step or so; wait for the engine to go idle.
    assert asyncio.run(_wait_idle(server)), "requests still unfinished on the server"
    for i, request_id, _ in results:
        ended = server.ended[request_id]
        if i in quitters:
            assert ended.finish_reason.startswith("abort"), (i, ended)
            assert ended.num_generation_tokens < max_tokens
        else:
            assert ended.finish_reason == "length" and ended.num_generation_tokens == max_tokens
    assert_idle(server)


QUITTER_MAX_TOKENS = 96  # far beyond a quitter's 2-6 tokens: its hang-up lands before its last token


async def streams_with_disconnects(url: str, prompts: list[list[int]], max_tokens: int,
                                   quitters: set[int]) -> list[tuple[int, str, list[int] | None]]:
    """Every prompt as a greedy stream at once; prompt i of `quitters` asks for QUITTER_MAX_TOKENS
    and hangs up after 2 + i % 5 tokens (so a loaded machine cannot finish it before the hang-up
    reaches the engine). (index, request id, token ids or None for a quitter) per prompt."""
    async def one(aclient, i):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=QUITTER_MAX_TOKENS if i in quitters else max_tokens,
            temperature=0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True})
        ids, request_id = [], None
        async for chunk in stream:
            request_id = chunk.id
            for c in chunk.choices:
                ids += c.token_ids
            if i in quitters and len(ids) >= 2 + i % 5:
                await stream.close()
                return i, request_id, None
        return i, request_id, ids

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as aclient:
        return await asyncio.gather(*(one(aclient, i) for i in range(len(prompts))))


async def greedy_streams(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt as a greedy stream at once; the token ids each got."""
    async def one(aclient, prompt):
        ids = []
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                  stream=True, extra_body={"return_token_ids": True,
                                                                           "ignore_eos": True})
        async for chunk in stream:
            for c in chunk.choices:
                ids += c.token_ids
        return ids

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as aclient:
        return await asyncio.gather(*(one(aclient, p) for p in prompts))


async def _wait_idle(server, timeout_s: float = 30.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while server.llm_engine.has_unfinished_requests():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.05)
    return True


BAD_REQUESTS = [  # (endpoint, body changes, status, field named)
    ("completions", {"temperature": -1}, 400, "temperature"),
    ("completions", {"top_p": 0}, 400, "top_p"),
    ("completions", {"top_k": -5}, 400, "top_k"),
    ("completions", {"min_p": 2}, 400, "min_p"),
    ("completions", {"n": 0}, 400, "n"),
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {"max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("completions", {"stop": [""]}, 400, "stop"),
    ("completions", {"seed": "x"}, 400, "seed"),
    ("completions", {"logprobs": -1}, 400, "logprobs"),
    ("completions", {"priority": "high"}, 400, "priority"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, 300]}, 400, "prompt"),
    ("completions", {"prompt": [1] * (MAX_MODEL_LEN + 1)}, 400, "prompt"),
    ("completions", {"prompt": 123}, 400, "prompt"),
    ("completions", {"prompt": None}, 400, "prompt"),
    ("completions", {"prompt": [[1, 2], [3, 300]]}, 400, "prompt"),  # one bad prompt of several
    ("completions", {"prompt": [True, 2]}, 400, "prompt"),  # token ids are JSON integers, not booleans
    ("completions", {"prompt": [1.5, 2]}, 400, "prompt"),
    ("completions", {"temperature": "hot"}, 400, "temperature"),
    ("completions", {"temperature_typo": 1}, 400, "temperature_typo"),
    ("completions", {"echo": True}, 400, "echo"),
    ("completions", {"logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ("completions", {"logprobs": 21}, 400, "logprobs"),  # over max_logprobs (20): refused at the door
    ("completions", {"logprobs": 10**6}, 400, "logprobs"),  # over the vocabulary
    ("completions", {"prompt": "\ud800x"}, 400, "prompt"),  # a lone surrogate: no tokenizer encodes it
    ("completions", {"prompt": ["ok", "a\udfffb"]}, 400, "prompt"),
    ("completions", {"response_format": {"type": "json_object"}}, 400, "response_format"),
    ("completions", {"model": "other"}, 404, "model"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("chat", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat", {"top_logprobs": 2}, 400, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 10**6}, 400, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800x"}]}, 400, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, 400, "messages"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {}}}, 400, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("chat", {"tool_choice": "auto"}, 400, "tool_choice"),
    ("chat", {"parallel_tool_calls": False}, 400, "parallel_tool_calls"),
    ("chat", {"chat_template_kwargs": {"enable_thinking": False}}, 400, "chat_template_kwargs"),
    ("chat", {"model": "other"}, 404, "model"),
]


@pytest.mark.parametrize("endpoint,change,status,field", BAD_REQUESTS,
                         ids=[f"{e}-{next(iter(c))}-{s}" for e, c, s, _ in BAD_REQUESTS])
def test_bad_request_then_a_good_one(server, client, endpoint, change, status, field):
    if endpoint == "completions":
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, **change}
        path = "/v1/completions"
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **change}
        path = "/v1/chat/completions"
    # JSON with \u escapes: a lone surrogate travels as "\ud800", as any JSON encoder may send it.
    resp = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] is not None and error["param"].split(".")[0] == field, error
    assert field in error["message"], error
    if field in ("response_format", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"):
        assert "not supported by this server" in error["message"], error
    # The official client raises the matching error type, and the server then serves. (It encodes
    # bodies as UTF-8, which a lone surrogate cannot be: those rows are sent above only.)
    if utf8_encodable(body):
        with pytest.raises(openai.APIStatusError) as info:
            client.post(path.removeprefix("/v1"), body=body, cast_to=object)
        assert info.value.status_code == status
    good = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, temperature=0)
    assert good.choices[0].finish_reason == "length" and good.usage.completion_tokens == 3


def utf8_encodable(body: dict) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def test_full_queue_answers_503_then_serves(model_dir):
    """At most 2 running and 2 waiting: of 8 requests sent at once, the ones past the cap are
    refused at once with 503; the admitted ones finish, and a later request is served."""
    engine = AsyncLLMEngine(LLMEngine(engine_args(model_dir, max_num_seqs=2, num_gpu_blocks=64)),
                            max_waiting_requests=2)
    check_full_queue_answers_503_then_serves(engine)


def check_full_queue_answers_503_then_serves(engine: AsyncLLMEngine) -> None:
    """8 requests at once against 2 running + 2 waiting slots: 200s and 503s only, then a good request."""
    with ServerThread(build_app(engine, MODEL)) as srv:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(8)))

        statuses = sorted(r.status_code for r in asyncio.run(main()))
        assert statuses.count(200) >= 2 and 503 in statuses and set(statuses) <= {200, 503}
        resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [4], "max_tokens": 2})
        assert resp.status_code == 200


def test_the_benchmark_client_against_the_server(server, tmp_path):
    """experiments.run backend=server: a Poisson workload over HTTP, in experiments.run's schema."""
    from experiments.bench_serving import bench
    from experiments.lib.traces import load_run
    from policies.trace import REQUEST_COLUMNS

    summary = bench([f"backend.url={server.url}", "model=tiny-llama", "workload=poisson",
                     "workload.num_requests=12", "workload.rate=50", "workload.prompt_len.low=4",
                     "workload.prompt_len.high=30", "workload.output_len.low=2", "workload.output_len.high=12",
                     "progress=false", "plots=false"], out=tmp_path)
    assert summary["completed"] == 12 and summary["run"]["failed"] == 0
    assert summary["run"]["served_model"] == MODEL
    run = load_run(tmp_path)
    assert list(run.requests.columns) == list(REQUEST_COLUMNS)
    assert (run.requests["ttft"] > 0).all() and (run.requests["e2e"] >= run.requests["ttft"]).all()
    lens = run.requests.set_index("request_id")["output_len"]
    assert summary["total_output_tokens"] == int(lens.sum())
    assert summary["ttft"]["mean"] > 0 and summary["output_throughput"] > 0


def test_the_benchmark_refuses_a_non_loopback_url():
    from experiments.lib.serving_client import check_loopback

    assert check_loopback("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert check_loopback("http://localhost:9") == "http://localhost:9"
    with pytest.raises(ValueError, match="backend.url"):
        check_loopback("http://10.1.2.3:8000")
    with pytest.raises(ValueError, match="backend.url"):
        check_loopback("ftp://127.0.0.1:8000")


def test_sse_stream_format(server):
    """Raw bytes: `data: {json}` events, a usage event when asked, `data: [DONE]` last."""
    body = {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in resp.iter_lines() if ln]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert sum(1 for c in chunks if c["choices"]) == 3  # one chunk per step for one request


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_entry_point(tmp_path):
    """`python -m engine.serve` as a user starts it: Hydra-style overrides, loopback, one request,
    a clean stop; a bad override is one line on stderr and exit code 2."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    bad = subprocess.run([sys.executable, "-m", "engine.serve", "--model", "tiny-llama", "bogus=1"],
                         capture_output=True, text=True, timeout=120, env=env, check=False)
    assert bad.returncode == 2 and "bogus" in bad.stderr and "Traceback" not in bad.stderr
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--model", "tiny-llama", "--port", str(port),
                             "--log-level", "warning", "num_gpu_blocks=32", "max_model_len=64", "--max-num-seqs", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(model="tiny-llama", prompt=[3, 4, 5], max_tokens=5)
        assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) is not None


def test_a_dead_engine_turns_health_bad_and_answers_503(model_dir):
    """The engine loop dies mid-request (a step raises): the open request gets an error, /health
    answers 503, and new requests are refused with 503 instead of hanging."""
    llm_engine = LLMEngine(engine_args(model_dir, num_gpu_blocks=32))
    engine = AsyncLLMEngine(llm_engine)
    with ServerThread(build_app(engine, MODEL)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2).usage.completion_tokens == 2
        steps = {"n": 0}
        real_step = llm_engine.step

        def failing_step():
            steps["n"] += 1
            if steps["n"] == 3:
                raise RuntimeError("device lost")
            return real_step()

        llm_engine.step = failing_step
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 20, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as resp:
            events = [ln for ln in resp.iter_lines() if ln]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == 503 and "device lost" in error["message"]
        health = httpx.get(srv.url + "/health")
        message = health.json()["error"]["message"]
        assert health.status_code == 503 and "device lost" in message
        assert "Traceback" not in message and "File " not in message and len(message) < 400
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
        assert info.value.status_code == 503


@pytest.mark.gpu
def test_server_on_the_gpu_equals_llm_generate():
    """The same over CUDA (Triton kernels, CUDA graphs): 32 concurrent greedy streams."""
    args = EngineArgs(model="tiny-llama", num_gpu_blocks=512, max_model_len=256, device="cuda")
    prompts = [[(7 * i + j) % 256 for j in range(5 + 3 * i)] for i in range(32)]
    want = LLM("tiny-llama", num_gpu_blocks=512, max_model_len=256, device="cuda").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    with ServerThread(build_app(AsyncLLMEngine(LLMEngine(args)), MODEL)) as srv:
        assert asyncio.run(greedy_streams(srv.url, prompts, 20)) == [w.outputs[0].token_ids for w in want]


def test_priority_reaches_the_scheduler(model_dir):
    """vLLM's `priority` field drives the priority policy: with one running slot busy, a request of
    priority 0 sent after one of priority 5 is served first."""
    engine = AsyncLLMEngine(LLMEngine(engine_args(model_dir, max_num_seqs=1, num_gpu_blocks=64, policy="priority")))
    ended = []
    engine.add_finished_observer(lambda r: ended.append(r.request_id))
    with ServerThread(build_app(engine, MODEL)) as srv:
        async def main():
            async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as aclient:
                def send(prio, max_tokens):
                    return aclient.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=max_tokens,
                                                      extra_body={"priority": prio, "ignore_eos": True})
                first = await aclient.completions.create(model=MODEL, prompt=[4, 5], max_tokens=60, stream=True,
                                                         extra_body={"ignore_eos": True})
                await anext(aiter(first))  # the only running slot is taken
                low = asyncio.ensure_future(send(5, 3))
                await asyncio.sleep(0.05)
                high = asyncio.ensure_future(send(0, 3))
                async for _ in first:
                    pass
                return (await low).id, (await high).id

        low_id, high_id = asyncio.run(main())
    assert ended.index(high_id) < ended.index(low_id)
