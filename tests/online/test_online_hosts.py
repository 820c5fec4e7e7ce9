"""AsyncLLMEngine over a host the test drives by hand (the `EngineHost` interface): a request's
first output reaches its consumer before the outputs of streams already going in the same step, so
a client waiting for its first token is not queued behind every running stream's chunk."""
from __future__ import annotations

import asyncio

from engine.offline.outputs import CompletionOutput, RequestOutput
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.online.host import ModelInfo, NewRequest, ResultSink, StepResult
from experiments.lib.frontend_host_stub import InstantHost
from policies.request import SamplingParams


class ScriptedBackend(InstantHost):
    """Takes requests and lets the test hand back whatever step results it wants (the rest of the
    host interface: the front-end probe's idle stand-in)."""

    def __init__(self) -> None:
        super().__init__(tokens=0)
        self.info = ModelInfo("scripted", 64, 100, None, 20)
        self.added: list[str] = []
        self.sink: ResultSink | None = None

    def bind(self, loop: asyncio.AbstractEventLoop, sink: ResultSink) -> None:
        self.sink = sink

    @property
    def is_running(self) -> bool:
        return self.sink is not None

    def add(self, request: NewRequest) -> None:
        self.added.append(request.request_id)


def _output(request_id: str, token: int) -> RequestOutput:
    return RequestOutput(request_id, None, [1], [CompletionOutput(0, "", [token], None)], False)


def test_first_outputs_reach_their_consumers_first():
    host = ScriptedBackend()
    engine = AsyncLLMEngine(host)
    params = SamplingParams(max_tokens=8)

    async def main() -> list[str]:
        order: list[str] = []

        async def consume(request_id: str, count: int) -> None:
            seen = 0
            async for _ in engine.generate([1], params, request_id, output_kind="delta"):
                order.append(request_id)
                seen += 1
                if seen == count:
                    return

        old = [asyncio.create_task(consume(f"old{i}", 2)) for i in range(3)]
        await asyncio.sleep(0)
        host.sink(StepResult({}, [(_output(f"old{i}", 5), None) for i in range(3)]))
        await asyncio.sleep(0)
        new = asyncio.create_task(consume("new", 1))
        await asyncio.sleep(0)
        order.clear()
        # One step: the running streams' next tokens, and (scheduler order: last) the new one's first.
        host.sink(StepResult({}, [*((_output(f"old{i}", 6), None) for i in range(3)), (_output("new", 7), None)]))
        await asyncio.gather(*old, new)
        await engine.shutdown()
        return order

    order = asyncio.run(main())
    assert order[0] == "new" and sorted(order[1:]) == ["old0", "old1", "old2"]
    assert host.added == ["old0", "old1", "old2", "new"]
