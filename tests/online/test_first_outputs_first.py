"""A step's first outputs go first on the way out of a core process: the core sends them in a message
of their own ahead of the running streams' (engine/online/engine_core.py), and `ProcessHost`
(engine/online/process_host.py) hands them over before the others, so a new request's consumer
holds its first token before the step's running streams' outputs are rebuilt and delivered; no
output ever overtakes an earlier one of its request."""
from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

from engine.offline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.online.engine_core import CoreStep
from engine.online.engine_stats import EngineStats
from engine.online.host import StepResult
from engine.online.output_wire import OutputPacker
from engine.online.process_host import ProcessHost
from policies.request import SamplingParams
from policies.routing.replica_report import ReplicaReport


class StubClient:
    """A core's client with no process: the test hands the host its messages."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(model_name="stub", max_model_len=64, vocab_size=100, max_logprobs=20)
        self.tokenizer = None
        self.channel = SimpleNamespace(attach=lambda *a: None, send=lambda m: None, detach=lambda close=False: None)
        self.alive = True

    def shutdown(self, timeout_s: float) -> None:
        pass


def output(request_id: str, token: int) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, "", [token], None)], False,
                         RequestMetrics(1.0, 1.5, 2.0, None, 0), 0, None)


def message(packer: OutputPacker, outputs: list[RequestOutput]) -> CoreStep:
    """What crosses the pipe for a step with these outputs."""
    step = CoreStep({}, 0, [packer.pack(o) for o in outputs], [], EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0),
                    ReplicaReport(0, 0, 0, 0, 8, 0, 16))
    return pickle.loads(pickle.dumps(step))


def handed(result: StepResult) -> list[tuple[str, list[int]]]:
    return [(o.request_id, o.outputs[0].token_ids) for o, _ in result.outputs]


def test_the_core_sends_a_steps_first_outputs_in_a_message_of_their_own_ahead():
    from engine.online.engine_core import _first_apart

    packer = OutputPacker()
    packer.pack(output("a", 5))
    step = [output("a", 6), output("b", 5), output("c", 5)]
    assert _first_apart(packer, step) == [step[1:], step[:1]]
    assert _first_apart(packer, step[:1]) == [step[:1]]  # running streams only: one message
    assert _first_apart(packer, step[1:]) == [step[1:]]  # first outputs only: one message


def test_first_outputs_first_and_no_output_overtakes_another():
    async def main() -> tuple[list, list]:
        host, packer, results = ProcessHost(StubClient()), OutputPacker(), []
        host.bind(asyncio.get_running_loop(), lambda r: results.append(handed(r)))
        for request_id in "abc":
            host.add(SimpleNamespace(request_id=request_id, prompt=[1, 2]))
        host._on_message(message(packer, [output("a", 5), output("b", 5)]))  # first outputs only: one hand-over
        host._on_message(message(packer, [output("a", 6), output("b", 6), output("c", 5)]))
        assert results == [[("a", [5]), ("b", [5])], [("c", [5])]]  # c's first output alone, at once
        await asyncio.sleep(0)  # the next loop turn: the held-back outputs
        host._on_message(message(packer, [output("a", 7), output("c", 6)]))  # no first output: all at once
        host._on_message(message(packer, [output("a", 8), output("d", 5)]))  # d: not told of, still first
        host._on_message(message(packer, [output("a", 9)]))  # the same turn: held behind d's, after a's 8
        held = list(results)
        await asyncio.sleep(0)
        return held, results

    held, results = asyncio.run(main())
    assert held == [[("a", [5]), ("b", [5])], [("c", [5])], [("a", [6]), ("b", [6])], [("a", [7]), ("c", [6])],
                    [("d", [5])], []]  # the last message's report is handed over at once, its output held
    assert results == [*held, [("a", [8]), ("a", [9])]]


def test_a_new_streams_consumer_holds_its_first_token_before_the_running_ones_get_theirs():
    async def main() -> list[str]:
        host, packer = ProcessHost(StubClient()), OutputPacker()
        engine = AsyncLLMEngine(host)
        params, order = SamplingParams(max_tokens=8), []

        async def consume(request_id: str, count: int) -> None:
            seen = 0
            async for out in engine.generate([1, 2], params, request_id, output_kind="delta"):
                order.append(f"{request_id}{out.outputs[0].token_ids[0]}")
                if request_id == "c":  # the running streams' outputs of its step are not even rebuilt yet
                    order.append("a6 handed over" if engine._streams["a"]._pending is not None else "a6 not yet")
                seen += 1
                if seen == count:
                    return

        tasks = [asyncio.ensure_future(consume(r, n)) for r, n in (("a", 2), ("b", 2))]
        await asyncio.sleep(0)
        host._on_message(message(packer, [output("a", 5), output("b", 5)]))
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(consume("c", 1)))
        await asyncio.sleep(0)
        host._on_message(message(packer, [output("a", 6), output("b", 6), output("c", 5)]))
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        await engine.shutdown()
        return order

    assert asyncio.run(main()) == ["a5", "b5", "c5", "a6 not yet", "a6", "b6"]
