"""`AsyncLLMEngine.shutdown()` stops what the engine started, in both modes, with tensor parallelism
(gloo on CPU): an engine built by `from_engine_args` is closed with its worker, a core process
stops and takes its engine's worker with it, and an engine the caller passed in stays open."""
from __future__ import annotations

import asyncio

from process_helpers import gone as _gone

from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from engine.online.async_llm_engine import AsyncLLMEngine
from policies.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _args(tp: int = 1) -> EngineArgs:
    return EngineArgs(model="tiny-llama", num_gpu_blocks=32, max_model_len=64, tensor_parallel_size=tp)


async def _tokens(engine: AsyncLLMEngine, request_id: str) -> list[int]:
    outs = [o async for o in engine.generate([1, 2, 3], GREEDY, request_id)]
    return outs[-1].outputs[0].token_ids


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_shutdown_closes_an_engine_it_built_with_its_workers():
    engine = AsyncLLMEngine.from_engine_args(_args(tp=2))
    runner = engine.engine.runner
    workers = list(runner._procs)
    assert workers and all(p.is_alive() for p in workers)

    async def main():
        tokens = await _tokens(engine, "r")
        await engine.shutdown()
        return tokens

    assert len(asyncio.run(main())) == 4
    assert runner._closed and runner.model is None
    assert not any(p.is_alive() for p in workers)


def test_shutdown_leaves_an_engine_the_caller_passed_open():
    inner = LLMEngine(_args())
    engine = AsyncLLMEngine(inner)

    async def main():
        tokens = await _tokens(engine, "r")
        await engine.shutdown()
        return tokens

    tokens = asyncio.run(main())
    assert inner.runner.model is not None
    inner.add_request("again", [1, 2, 3], GREEDY)
    while inner.has_unfinished_requests():
        outs = inner.step()
    assert outs[-1].outputs[0].token_ids == tokens
    inner.close()


def test_shutdown_stops_the_core_process_and_its_workers():
    engine = AsyncLLMEngine.from_engine_args(_args(tp=2), engine_process=True)
    core = engine._core.process
    workers = _children(core.pid)
    assert workers, "the core started no tensor-parallel worker"

    async def main():
        tokens = await _tokens(engine, "r")
        await engine.shutdown()
        return tokens

    assert len(asyncio.run(main())) == 4
    assert not core.is_alive() and core.exitcode == 0
    assert all(_gone(pid) for pid in workers)
