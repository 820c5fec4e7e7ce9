"""`--replica-launcher ray` on the CPU: two replicas as actors of a local Ray instance bound to
127.0.0.1 (two CPUs) serve greedy outputs equal to `LLM.generate`, and an actor killed mid-stream
fails only its own request, within a bound, and leaves the rotation; an actor stopped (SIGSTOP)
mid-stream is hung after the replica timeout: its request fails naming it, its actor is killed,
the other replica serves on."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from engine.engine_args import EngineArgs
from engine.offline.llm import LLM
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.online.replica_launcher import launch_replica_set
from engine.online.replica_set import ReplicaFailedError
from policies.request import SamplingParams
from policies.routing import make_router

BOUND_S = 30.0


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def args(model_dir: str) -> EngineArgs:
    return EngineArgs(model=model_dir, num_gpu_blocks=64, swap_space=0.01, max_model_len=128, device="cpu")


async def generate(engine: AsyncLLMEngine, prompt: list[int], request_id: str, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = [out async for out in engine.generate(prompt, params, request_id)]
    return outputs[-1].outputs[0].token_ids


def test_ray_replicas_serve_and_one_killed_leaves_the_rotation(model_dir, local_ray):
    prompts = [[1, 2, 3], [7, 8, 9, 10], [4, 5], [11, 12, 13]]
    want = LLM(model_dir, num_gpu_blocks=64, swap_space=0.01, max_model_len=128).generate(
        prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    replicas = launch_replica_set(args(model_dir), 2, make_router({"name": "round_robin"}), launcher="ray")
    engine = AsyncLLMEngine(replicas)

    async def main():
        got = await asyncio.wait_for(asyncio.gather(
            *(generate(engine, p, f"r{i}", 6) for i, p in enumerate(prompts))), BOUND_S)
        assert got == [w.outputs[0].token_ids for w in want]
        assert replicas.num_routed == [2, 2]
        # A long request on each replica; replica 1's actor is killed once both are running.
        long = [asyncio.ensure_future(generate(engine, [1, 2, 3], f"long{i}", 100)) for i in range(2)]
        for _ in range(int(BOUND_S / 0.01)):
            if all(r.requests for r in replicas.replicas):
                break
            await asyncio.sleep(0.01)
        ray.kill(replicas.replicas[1].host.client.actor)
        done = await asyncio.wait_for(asyncio.gather(*long, return_exceptions=True), BOUND_S)
        assert len(done[0]) == 100
        assert isinstance(done[1], ReplicaFailedError) and "replica 1 stopped" in str(done[1])
        assert [r.alive for r in replicas.replicas] == [True, False]
        assert await asyncio.wait_for(generate(engine, [4, 5], "after", 3), BOUND_S) == want[2].outputs[0].token_ids[:3]
        assert replicas.num_routed == [4, 3]
        health = engine.health_detail()["replicas"]
        assert [r["alive"] for r in health] == [True, False] and health[1]["error"]
        await engine.shutdown()

    asyncio.run(main())


def test_a_hung_ray_replica_fails_its_request_and_its_actor_is_killed(model_dir, local_ray):
    replicas = launch_replica_set(args(model_dir), 2, make_router({"name": "round_robin"}), launcher="ray",
                                  timeout_s=3.0)
    engine = AsyncLLMEngine(replicas)
    actor = replicas.replicas[1].host.client.actor
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=BOUND_S)

    async def main():
        long = [asyncio.ensure_future(generate(engine, [1, 2, 3], f"long{i}", 120)) for i in range(2)]
        for _ in range(int(BOUND_S / 0.01)):
            if all(r.host.stats().generation_tokens_total for r in replicas.replicas):
                break
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        done = await asyncio.wait_for(asyncio.gather(*long, return_exceptions=True), BOUND_S)
        assert len(done[0]) == 120
        assert isinstance(done[1], ReplicaFailedError), done[1]
        assert "replica 1 stopped" in str(done[1]) and "hung" in str(done[1]), done[1]
        assert time.monotonic() - started < BOUND_S
        assert [r.alive for r in replicas.replicas] == [True, False]
        await asyncio.wait_for(replicas.replicas[1].stopping, BOUND_S)
        assert await asyncio.wait_for(generate(engine, [4, 5], "after", 3), BOUND_S)
        assert replicas.num_routed == [2, 1]
        await engine.shutdown()

    try:
        asyncio.run(main())
        with pytest.raises(ray.exceptions.RayActorError):  # killed: it answers no more
            ray.get(actor.info.remote(), timeout=BOUND_S)
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone once killed
            os.kill(pid, signal.SIGCONT)
