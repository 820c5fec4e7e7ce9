"""The OpenAI-compatible server over a disaggregated pair (a prefill engine in the server's thread
host, a decode engine in its own process; CPU, gloo), driven by the `openai` client: greedy
completions, whole and streamed, and n = 2 equal `LLM.generate` on a co-located engine over the
same weights; streams that hang up mid-way are aborted wherever their request is (prefilling,
moving, decoding), leaving no request and no prefill KV block behind, while the others get their
tokens; with the pair's prefill engine synchronous and scheduled ahead."""
from __future__ import annotations

import asyncio
import random

import pytest
from engine_helpers import ragged_prompts
from optional_deps import require_serving

openai = pytest.importorskip("openai")
require_serving()

from engine.disagg.pd_engine import DisaggregatedEngine
from engine.engine_args import EngineArgs
from engine.offline.llm import LLM
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.online.thread_host import ThreadHost
from engine.serving.app import build_app
from engine.serving.server import ServerThread
from policies.request import SamplingParams

MODEL = "tiny"
ARGS = {"num_gpu_blocks": 256, "swap_space": 0.01, "max_model_len": 128}


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(model_dir, **ARGS)


# The pair as `engine.serve --disaggregation SPEC` builds it: its prefill engine synchronous, and
# scheduled ahead.
@pytest.fixture(scope="module", params=["", ",prefill_async_scheduling=true"], ids=["sync", "ahead"])
def server(model_dir, request):
    pair = DisaggregatedEngine(EngineArgs(model=model_dir, **ARGS),
                               "prefill=1,decode=1,transfer_timeout_s=10" + request.param)
    engine = AsyncLLMEngine(ThreadHost(pair, close_engine=True))
    with ServerThread(build_app(engine, MODEL)) as srv:
        srv.pair = pair
        yield srv
    pair.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _greedy(reference, prompts, max_tokens):
    return reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                              use_tqdm=False)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_equal_llm_generate(client, reference, stream):
    prompts = ragged_prompts(3, seed=11, max_len=30)
    want = _greedy(reference, [*prompts, "The quick brown fox"], 12)
    for prompt, w in zip([*prompts, "The quick brown fox"], want):
        kw = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
              "extra_body": {"return_token_ids": True, "ignore_eos": True}}
        if stream:
            ids, text = [], ""
            for chunk in client.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    ids += c.token_ids
                    text += c.text
        else:
            out = client.completions.create(**kw)
            ids, text = out.choices[0].token_ids, out.choices[0].text
        assert ids == w.outputs[0].token_ids and text == w.outputs[0].text


def test_parallel_samples(client, reference):
    prompts = ragged_prompts(2, seed=12, max_len=20)
    want = _greedy(reference, prompts, 5)
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    for c in out.choices:
        assert c.token_ids == want[c.index // 2].outputs[0].token_ids


def test_hang_ups_are_aborted_wherever_the_request_is(server, reference):
    rng = random.Random(0)
    prompts = ragged_prompts(24, seed=13, max_len=24)
    want = _greedy(reference, prompts, 16)
    quitters = set(rng.sample(range(24), 8))
    results = asyncio.run(_streams(server.url, prompts, 16, quitters))
    for i, ids in results:
        if i not in quitters:
            assert ids == want[i].outputs[0].token_ids, i
    assert asyncio.run(_wait_idle(server.pair)), "requests still unfinished"
    pair = server.pair
    assert not pair.side.transferring and not pair._decoding
    bm = pair.prefill.scheduler.block_manager
    assert bm.num_free_gpu_blocks() == bm.num_gpu_blocks
    assert (pair.prefill.scheduler.num_scheduled_ahead > 0) is pair.config.prefill_async_scheduling


async def _streams(url, prompts, max_tokens, quitters):
    async def one(aclient, i):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True})
        if i in quitters and i % 2:  # before any token: while it prefills or moves
            await stream.close()
            return i, None
        ids = []
        async for chunk in stream:
            for c in chunk.choices:
                ids += c.token_ids
            if i in quitters and len(ids) >= 2:
                await stream.close()
                return i, None
        return i, ids

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as aclient:
        return await asyncio.gather(*(one(aclient, i) for i in range(len(prompts))))


async def _wait_idle(pair, timeout_s: float = 30.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while pair.has_unfinished_requests():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.05)
    return True
