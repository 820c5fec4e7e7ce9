"""The server over two data-parallel replicas (`launch_replica_set`: two engine core processes on
the CPU, the tiny model of tests/serving/test_serving_http.py) with the official `openai` client:
outputs equal `LLM.generate` whichever replica serves, streams that hang up are aborted on the
replica holding them, /metrics has per-replica series beside the fleet's; a replica killed
mid-stream fails only its own requests (within a bound), leaves the rotation, and /health and
/metrics say so; with none left, /health is 503."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from engine_helpers import ragged_prompts

httpx = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")

from test_serving_http import (  # noqa: F401 (its module-scoped fixtures, shared)
    MODEL,
    QUITTER_MAX_TOKENS,
    TEMPLATE,
    engine_args,
    greedy,
    greedy_streams,
    reference,
    streams_with_disconnects,
)

from engine.online.async_llm_engine import AsyncLLMEngine
from engine.online.replica_launcher import launch_replica_set
from engine.serving.app import build_app
from engine.serving.server import ServerThread
from policies.routing import make_router

BOUND_S = 20.0  # every wait below ends by then


def fleet_engine(model_dir: str, router: str = "round_robin", **kw) -> AsyncLLMEngine:
    replicas = launch_replica_set(engine_args(model_dir, **kw), 2, make_router({"name": router}))
    return AsyncLLMEngine(replicas)


@pytest.fixture(scope="module")
def server(model_dir):
    engine = fleet_engine(model_dir)
    ended = {}
    engine.add_finished_observer(lambda r: ended.__setitem__(r.request_id, r))
    with ServerThread(build_app(engine, MODEL, TEMPLATE)) as srv:
        srv.engine, srv.ended = engine, ended
        yield srv
    assert not any(r.host.client.alive for r in engine._host.replicas)  # the app's shutdown stopped them


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=BOUND_S)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the series `name` with exactly `labels` (besides model_name)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(kv.split("=", 1) for kv in line[len(name) + 1:line.index("}")].split(","))
        got = {k: v.strip('"') for k, v in got.items() if k != "model_name"}
        if got == labels:
            return float(line.split()[-1])
    raise KeyError((name, labels))


async def wait_idle(engine: AsyncLLMEngine) -> bool:
    end = time.monotonic() + BOUND_S
    while time.monotonic() < end:
        s = engine.stats()
        if s.num_running == s.num_waiting == 0 and s.kv_cache_usage == 0.0 and not engine._host._owner:
            return True
        await asyncio.sleep(0.05)
    return False


def test_both_replicas_serve_what_llm_generate_gives(server, client, reference):  # noqa: F811
    prompts = ragged_prompts(4, seed=21, max_len=30)
    want = greedy(reference, prompts, 10)
    for prompt, w in zip(prompts, want):
        kw = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0,
              "extra_body": {"return_token_ids": True, "ignore_eos": True}}
        whole = client.completions.create(**kw)
        assert whole.choices[0].token_ids == w.outputs[0].token_ids
        ids = [t for chunk in client.completions.create(stream=True, **kw) for c in chunk.choices for t in c.token_ids]
        assert ids == w.outputs[0].token_ids
    assert server.engine._host.num_routed[0] > 0 and server.engine._host.num_routed[1] > 0
    served = {r.replica for r in server.ended.values()}
    assert served == {0, 1}


def test_hang_ups_are_aborted_on_the_replica_holding_them(server, reference):  # noqa: F811
    prompts = ragged_prompts(12, seed=23, max_len=20)
    want = greedy(reference, prompts, 20)
    # The 12 streams open at once, so they reach the round-robin router in any order: each replica
    # gets 6 of them, and 7 quitters put at least one hang-up on each replica whatever the order.
    quitters = {1, 2, 4, 6, 7, 9, 11}

    async def main():
        return await streams_with_disconnects(server.url, prompts, 20, quitters), await wait_idle(server.engine)

    results, idle = asyncio.run(main())
    assert idle, server.engine.stats()
    for i, request_id, ids in results:
        ended = server.ended[request_id]
        if i in quitters:
            assert ended.finish_reason.startswith("abort") and ended.num_generation_tokens < QUITTER_MAX_TOKENS, (i, ended)
        else:
            assert ids == want[i].outputs[0].token_ids, i
    assert {server.ended[r].replica for i, r, _ in results if i in quitters} == {0, 1}


def test_metrics_per_replica_and_for_the_fleet(server, client):
    client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:generation_tokens_total",
                 "vllm:prompt_tokens_total"):
        fleet = metric(text, name)
        assert fleet == metric(text, name, replica="0") + metric(text, name, replica="1") > 0, name
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "servelab:replica_up", replica="0") == metric(text, "servelab:replica_up", replica="1") == 1
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and [r["alive"] for r in health.json()["replicas"]] == [True, True]


def test_a_killed_replica_fails_its_requests_and_the_other_serves(model_dir):
    engine = fleet_engine(model_dir, num_gpu_blocks=32)
    replicas = engine._host.replicas
    with ServerThread(build_app(engine, MODEL)) as srv:
        body = {"model": MODEL, "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "prompt": [1, 2, 3]},
                          timeout=BOUND_S) as first, \
                httpx.stream("POST", srv.url + "/v1/completions", json={**body, "prompt": [4, 5, 6]},
                             timeout=BOUND_S) as second:
            lines = [first.iter_lines(), second.iter_lines()]
            for it in lines:
                assert next(ln for ln in it if ln).startswith("data: {")
            assert [len(r.requests) for r in replicas] == [1, 1]  # round robin: one on each
            started = time.monotonic()
            replicas[1].host.client.process.kill()
            killed = [ln for ln in lines[1] if ln]
            assert time.monotonic() - started < BOUND_S
            survived = [ln for ln in lines[0] if ln]
        assert killed[-1] == "data: [DONE]"
        error = json.loads(killed[-2][6:])["error"]
        assert "replica 1 stopped" in error["message"]
        assert survived[-1] == "data: [DONE]" and json.loads(survived[-2][6:])["choices"][0]["finish_reason"] == "length"
        health = httpx.get(srv.url + "/health", timeout=BOUND_S)
        assert health.status_code == 200
        assert [(r["replica"], r["alive"]) for r in health.json()["replicas"]] == [(0, True), (1, False)]
        assert "exit" in health.json()["replicas"][1]["error"]
        text = httpx.get(srv.url + "/metrics", timeout=BOUND_S).text
        assert metric(text, "servelab:replica_up", replica="1") == 0
        for _ in range(3):  # every new request goes to the live replica
            resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [7], "max_tokens": 2},
                              timeout=BOUND_S)
            assert resp.status_code == 200
        assert engine._host.num_routed == [4, 1]
        replicas[0].host.client.process.kill()
        end = time.monotonic() + BOUND_S
        while httpx.get(srv.url + "/health", timeout=BOUND_S).status_code != 503:
            assert time.monotonic() < end, "health never turned 503 with no replica left"
            time.sleep(0.05)
        resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [7], "max_tokens": 2},
                          timeout=BOUND_S)
        assert resp.status_code == 503


def test_replicas_get_their_own_gpus():
    from engine.engine_args import EngineArgs
    from engine.online.replica_launcher import replica_args

    one = EngineArgs(model="tiny-qwen3", device="cuda")
    assert [replica_args(one, i, 2, gpus=2).device for i in range(2)] == ["cuda:0", "cuda:1"]
    tp = EngineArgs(model="tiny-qwen3", device="cuda:1", tensor_parallel_size=2)
    assert [replica_args(tp, i, 2, gpus=5).device for i in range(2)] == ["cuda:1", "cuda:3"]
    with pytest.raises(ValueError, match=r"^data_parallel_size=2 is invalid: 2 replicas of 2 GPU\(s\) from cuda:1 "
                                         r"need 5 GPUs, this machine has 4"):
        replica_args(tp, 0, 2, gpus=4)
    cpu = EngineArgs(model="tiny-qwen3", device="cpu")
    assert replica_args(cpu, 1, 2, cores=2).device == "cpu"
    with pytest.raises(ValueError, match=r"^data_parallel_size=3 is invalid: 3 CPU replicas \(each a process with "
                                         r"its own engine\) on a machine of 2 cores: at most 2"):
        replica_args(cpu, 0, 3, cores=2)


@pytest.mark.parametrize("argv, message", [
    (["--router-arg", "cach_threshold=2"], "error: router.cach_threshold is unknown for router 'prefix_aware': allowed"),
    (["--router-arg", "cache_threshold=2"], "error: router.cache_threshold=2 is invalid: must be a number in [0, 1]"),
    (["--router-arg", "cache_threshold"], "error: --router-arg 'cache_threshold' is invalid: write KEY=VALUE"),
    (["--data-parallel-size", "0"], "error: data_parallel_size=0 is invalid: must be an integer >= 1"),
    (["--replica-launcher", "k8s"], "error: replica_launcher='k8s' is unknown: choose a replica launcher from"),
    (["--data-parallel-size", "100000"], "error: data_parallel_size=100000 is invalid: 100000 CPU replicas"),
])
def test_bad_replica_options_are_one_line(capsys, argv, message):
    from engine.serve import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", "tiny-qwen3", "--device", "cpu", "--num-gpu-blocks", "16", "--max-model-len", "256",
              "--data-parallel-size", "2",
              "--router", "prefix_aware", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


@pytest.mark.gpu
def test_two_gpu_replicas_serve_on_their_own_devices():
    """Two replicas on cuda:0 and cuda:1 (Triton kernels, CUDA graphs): 16 concurrent greedy streams
    equal LLM.generate on one GPU, whichever replica serves them; both stop with the server."""
    import torch

    from engine.engine_args import EngineArgs
    from engine.offline.llm import LLM
    from policies.request import SamplingParams

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    prompts = [[(7 * i + j) % 256 for j in range(5 + 3 * i)] for i in range(16)]
    want = LLM("tiny-llama", num_gpu_blocks=512, max_model_len=256, device="cuda").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    args = EngineArgs(model="tiny-llama", num_gpu_blocks=512, max_model_len=256, device="cuda")
    replicas = launch_replica_set(args, 2, make_router({"name": "round_robin"}))
    assert [r.host.client.args.device for r in replicas.replicas] == ["cuda:0", "cuda:1"]
    engine = AsyncLLMEngine(replicas)
    with ServerThread(build_app(engine, MODEL)) as srv:
        assert asyncio.run(greedy_streams(srv.url, prompts, 20)) == [w.outputs[0].token_ids for w in want]
    assert replicas.num_routed == [8, 8]
    assert not any(r.host.client.alive for r in replicas.replicas)
