"""The server with its engine in a core process (`AsyncLLMEngine(engine_process=True)`, the default of
`python -m engine.serve`), on CPU with the tiny model of tests/serving/test_serving_http.py and the official
`openai` client: outputs equal `LLM.generate`, 64 streams with a third disconnecting leave no request
and no KV block behind, bad requests fail alone, a killed core fails every open stream and turns
health to 503 without hanging anything, and no core process outlives its front end."""
from __future__ import annotations

import asyncio
import gc
import json
import random

import pytest
from engine_helpers import ragged_prompts
from process_helpers import gone as _gone

httpx = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")

from test_serving_http import (  # noqa: F401 (its module-scoped fixtures, shared)
    MAX_MODEL_LEN,
    MODEL,
    QUITTER_MAX_TOKENS,
    TEMPLATE,
    check_full_queue_answers_503_then_serves,
    engine_args,
    greedy,
    greedy_streams,
    reference,
    streams_with_disconnects,
)

from engine.online.async_llm_engine import AsyncLLMEngine
from engine.serving.app import build_app
from engine.serving.server import ServerThread


def process_engine(model_dir: str, **kw) -> AsyncLLMEngine:
    max_waiting = kw.pop("max_waiting_requests", None)
    return AsyncLLMEngine.from_engine_args(engine_args(model_dir, **kw), max_waiting_requests=max_waiting,
                                           engine_process=True)


@pytest.fixture(scope="module")
def server(model_dir):
    engine = process_engine(model_dir)
    ended = {}
    engine.add_finished_observer(lambda r: ended.__setitem__(r.request_id, r))
    with ServerThread(build_app(engine, MODEL, TEMPLATE)) as srv:
        srv.engine, srv.ended = engine, ended
        yield srv
    assert not engine._core.alive  # the app's shutdown stopped the core


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


async def wait_idle(engine: AsyncLLMEngine, timeout_s: float = 30.0) -> bool:
    """Every request ended and every KV block is free again, as the core reports."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        s = engine.stats()
        if s.num_running == s.num_waiting == s.num_swapped == 0 and s.kv_cache_usage == 0.0:
            return True
        if loop.time() > end:
            return False
        await asyncio.sleep(0.05)


def test_completions_and_chat_equal_llm_generate(client, reference):  # noqa: F811 (the imported fixture)
    prompts = [*ragged_prompts(3, seed=11, max_len=30), "The quick brown fox"]
    want = greedy(reference, prompts, 12)
    for prompt, w in zip(prompts, want):
        kw = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
              "extra_body": {"return_token_ids": True, "ignore_eos": True}}
        ids, text, reasons = [], "", []
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                ids += c.token_ids
                text += c.text
                reasons.append(c.finish_reason)
        assert ids == w.outputs[0].token_ids and text == w.outputs[0].text
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        whole = client.completions.create(**kw)
        assert whole.choices[0].token_ids == w.outputs[0].token_ids
        assert whole.usage.prompt_tokens == len(w.prompt_token_ids)
    out = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=5, temperature=0, n=2, logprobs=2,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    five = greedy(reference, prompts[:2], 5)
    assert [c.token_ids for c in out.choices] == [five[i // 2].outputs[0].token_ids for i in range(4)]
    assert all(len(c.logprobs.top_logprobs) == 5 for c in out.choices)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4 and chat.choices[0].message.role == "assistant"



def test_outputs_carry_their_prompts_as_in_process(model_dir):
    """`AsyncLLMEngine.generate` with a core process gives each output the prompt and prompt token ids
    the in-process engine gives: a token-id prompt's ids as handed over (they never cross the pipe
    back), a text prompt's ids as the core's tokenizer made them (the front end has none), with
    several samples, logprobs, and a request that ends at its first token."""
    from policies.request import SamplingParams

    cases = [([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
             ("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
             ([9, 10], SamplingParams(temperature=1.0, max_tokens=2, n=2, seed=3, logprobs=1, ignore_eos=True)),
             ("one token", SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))]

    def prompts_seen(engine: AsyncLLMEngine) -> list[set[tuple]]:
        """Per request, the (prompt, prompt token ids) its outputs carried (how many outputs a
        stream reads depends on timing: a slow reader's are merged)."""
        async def main():
            async def one(i, prompt, params):
                return {(o.prompt, tuple(o.prompt_token_ids)) async for o in engine.generate(prompt, params, f"r{i}")}

            try:
                return await asyncio.gather(*(one(i, *c) for i, c in enumerate(cases)))
            finally:
                await engine.shutdown()
        return asyncio.run(main())

    from engine.offline.llm_engine import LLMEngine

    want = prompts_seen(AsyncLLMEngine(LLMEngine(engine_args(model_dir))))
    assert want[0] == {(None, (5, 6, 7, 8))} and len(want[1]) == 1
    (text, ids), = want[1]
    assert text == "The quick brown fox" and len(ids) > 0
    assert prompts_seen(process_engine(model_dir)) == want

def test_metrics_come_from_the_core(server, client):
    """/metrics in process mode: the counters the core sends and the histograms of the RequestStats
    it computes for each ended request."""
    def value(text, name):
        return float(next(ln for ln in text.splitlines() if ln.startswith(name)).split()[-1])

    before = httpx.get(server.url + "/metrics").text
    client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    assert asyncio.run(wait_idle(server.engine))
    after = httpx.get(server.url + "/metrics").text
    for name, grew in (("vllm:generation_tokens_total", 6), ("vllm:prompt_tokens_total", 3),
                       ("vllm:e2e_request_latency_seconds_count", 1), ("vllm:time_to_first_token_seconds_count", 1),
                       ("vllm:inter_token_latency_seconds_count", 5)):
        assert value(after, name) - value(before, name) == grew, name
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:kv_cache_usage_perc") == 0


def test_concurrent_streams_with_disconnects(server, reference):  # noqa: F811 (the imported fixture)
    """64 streams, a random third hang up: aborted in the core, blocks freed, the rest exact."""
    rng = random.Random(1)
    prompts = ragged_prompts(64, seed=13, max_len=24)
    want = greedy(reference, prompts, 24)
    quitters = set(rng.sample(range(64), 64 // 3))

    async def main():
        return (await streams_with_disconnects(server.url, prompts, 24, quitters),
                await wait_idle(server.engine))

    results, idle = asyncio.run(main())
    assert idle, f"the core is not idle: {server.engine.stats()}"
    for i, request_id, ids in results:
        ended = server.ended[request_id]
        if i in quitters:
            assert ended.finish_reason.startswith("abort") and ended.num_generation_tokens < QUITTER_MAX_TOKENS, (i, ended)
        else:
            assert ids == want[i].outputs[0].token_ids, i
            assert ended.finish_reason == "length" and ended.num_generation_tokens == 24


@pytest.mark.parametrize("change,field", [({"temperature": -1}, "temperature"), ({"prompt": [1, 300]}, "prompt"),
                                          ({"max_tokens": MAX_MODEL_LEN}, "max_tokens")])
def test_bad_request_then_a_good_one(server, client, change, field):
    resp = httpx.post(server.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, **change})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field
    good = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, temperature=0)
    assert good.usage.completion_tokens == 3


def test_full_queue_answers_503_then_serves(model_dir):
    engine = process_engine(model_dir, max_num_seqs=2, num_gpu_blocks=64, max_waiting_requests=2)
    check_full_queue_answers_503_then_serves(engine)


def test_a_killed_core_fails_open_streams_and_health(model_dir):
    """The core process dies mid-stream (killed): the open stream ends with a 503 error event,
    /health answers 503, new requests get 503 at once; nothing hangs."""
    engine = process_engine(model_dir, num_gpu_blocks=32)
    with ServerThread(build_app(engine, MODEL)) as srv:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(ln for ln in lines if ln).startswith("data: {")
            engine._core.process.kill()
            events = [ln for ln in lines if ln]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == 503 and "engine process exited" in error["message"]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503
        resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [4], "max_tokens": 2},
                          timeout=30)
        assert resp.status_code == 503


def test_a_dropped_engine_leaves_no_core_process(model_dir):
    engine = process_engine(model_dir, num_gpu_blocks=16)
    process = engine._core.process
    assert process.is_alive()
    del engine
    gc.collect()
    process.join(10)
    assert not process.is_alive()


def test_a_core_that_cannot_start_is_one_clear_error(tmp_path):
    from engine.engine_args import EngineArgs

    """A bad argument is the ValueError naming it, as with the engine in this process."""
    with pytest.raises(ValueError, match=r"^model='.*missing' is unknown"):
        AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tmp_path / "missing"), num_gpu_blocks=16),
                                        engine_process=True)


def test_a_killed_server_leaves_no_core_process():
    """`python -m engine.serve` (engine process by default) killed with SIGKILL: its core process
    sees its pipe close and exits; none is left running."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from test_serving_http import _free_port

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--model", "tiny-llama", "--port", str(port),
                             "--log-level", "warning", "num_gpu_blocks=32", "max_model_len=64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        assert children, "the server started no core process"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in children):
        assert time.monotonic() < deadline, f"core process(es) left running: {children}"
        time.sleep(0.1)


@pytest.mark.gpu
def test_process_server_on_the_gpu_equals_llm_generate():
    """The core process on CUDA (Triton kernels, CUDA graphs): 32 concurrent greedy streams equal
    LLM.generate, and the core stops with the server."""
    from engine.engine_args import EngineArgs
    from engine.offline.llm import LLM
    from policies.request import SamplingParams

    args = EngineArgs(model="tiny-llama", num_gpu_blocks=512, max_model_len=256, device="cuda")
    prompts = [[(7 * i + j) % 256 for j in range(5 + 3 * i)] for i in range(32)]
    want = LLM("tiny-llama", num_gpu_blocks=512, max_model_len=256, device="cuda").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    engine = AsyncLLMEngine.from_engine_args(args, engine_process=True)
    with ServerThread(build_app(engine, MODEL)) as srv:
        assert asyncio.run(greedy_streams(srv.url, prompts, 20)) == [w.outputs[0].token_ids for w in want]
    assert not engine._core.alive


def test_a_tensor_parallel_core(model_dir, reference):  # noqa: F811 (the imported fixtures)
    """A core process whose engine spawns its own tensor-parallel worker (gloo on CPU): greedy
    streams equal LLM.generate's, and the core and its worker stop with the engine."""
    prompts = ragged_prompts(4, seed=14, max_len=20)
    want = greedy(reference, prompts, 8)
    engine = process_engine(model_dir, tensor_parallel_size=2)
    with ServerThread(build_app(engine, MODEL)) as srv:
        assert asyncio.run(greedy_streams(srv.url, prompts, 8)) == [w.outputs[0].token_ids for w in want]
    assert not engine._core.alive
