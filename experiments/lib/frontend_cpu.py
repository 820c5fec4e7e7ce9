"""The HTTP front end's own CPU per streamed request, without sockets, processes or a model.

`python frontend_cpu.py --out FILE [--prompt-len N] [--requests N]` (a copy of this file outside
any package, beside a copy of its host stand-ins (frontend_host_stub.py), run with PYTHONPATH at
the tree to measure: `experiments.bench_frontend --front-cpu`
runs it for this tree and for a baseline commit, so it imports only the engine's public API)
calls the app of `build_app` as uvicorn would (one ASGI call per request, the body in one message)
over an `AsyncLLMEngine` whose host answers at once: each request's outputs come on the next loop
turns, one token each (`--tokens`, default 4). Times per request, on one event loop, one request
at a time: `to_first_chunk` (the call to the first SSE chunk with a choice: the body parsed and
checked, the request built and handed over, the first output turned into a chunk) and `whole`
(to the end of the response), and, each in turn with those, `refused` (the same body for a
model the server does not serve: a 404 after the parse, the way through the app's layers alone).
What is left is what the server's event loop spends of its own on
the way to a first token, the part no transport or engine hides, measured with little noise.
`--wire 10 256`: also, per engine step with that many streams running, the core's packing and framing
of the step's outputs (`core_<n>`) and the front end's unpickling and rebuilding of them
(`front_<n>`), the per-step price of the pipe between them (engine/online/output_wire.py); and the
same for a step that carries one request's first output, whose prompt is `--prompt-len` token ids
as bench_online sends them (`core_first`, `front_first`: what each request's first token pays);
and, with that many streams running, a step that also brings a new request's first output (last,
as the scheduler orders a prefill after the decodes): the core's packing and framing until that
output's message is ready, plus the front end from the step's messages written to its pipe (its
reader, its host, AsyncLLMEngine) to that request's consumer holding its output (`first_among_<n>`: the first token's wait behind the step's other
outputs, in the core and on the event loop).
Writes {"to_first_chunk": [seconds, ...], "whole": [...], "refused": [...], "core_<n>": [...], "front_<n>": [...],
"core_first": [...], "front_first": [...], "first_among_<n>": [...]} as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from engine.offline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.online.engine_stats import EngineStats
from engine.serving.app import build_app

if __package__:  # imported from the tree (tests, experiments.bench_frontend)
    from experiments.lib.frontend_host_stub import MODEL, InstantHost, StubCoreClient, scope_for
else:  # run as the probe: a copy beside a copy of its host stand-ins (bench_frontend `_probe_trees`)
    from frontend_host_stub import MODEL, InstantHost, StubCoreClient, scope_for


async def measure(prompt_len: int, tokens: int, requests: int, warmup: int = 200) -> dict[str, list[float]]:
    app = build_app(AsyncLLMEngine(InstantHost(tokens)), MODEL)
    body = json.dumps({"model": MODEL, "prompt": [1 + i % 250 for i in range(prompt_len)], "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    # The same request for a model the server does not serve: refused with a 404 after the body is
    # parsed, no engine work, so its time is the way in through the app's layers and back out.
    refused_body = body.replace(json.dumps(MODEL).encode(), b'"not-served"', 1)
    scope = scope_for(body)
    first: list[float] = []
    whole: list[float] = []
    refused: list[float] = []

    async def one(body: bytes = body, scope: dict = scope) -> None:
        delivered, t_first = False, None
        t0 = time.perf_counter()

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays: cancelled when the response ends
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal t_first
            if t_first is None and message["type"] == "http.response.body" and b'"choices":[{' in message["body"]:
                t_first = time.perf_counter() - t0

        await app(dict(scope), receive, send)
        if body is refused_body:
            refused.append(time.perf_counter() - t0)
            return
        first.append(t_first)
        whole.append(time.perf_counter() - t0)

    for _ in range(warmup):
        await one()
        await one(refused_body, scope_for(refused_body))
    first.clear()
    whole.clear()
    refused.clear()
    for _ in range(requests):
        await one()
        await one(refused_body, scope_for(refused_body))
    return {"to_first_chunk": first, "whole": whole, "refused": refused}


def wire(streams: int, steps: int = 300) -> dict[str, list[float]]:
    """Per step, with `streams` requests running: the core packing their outputs and framing the
    step's message (`core`: with a request that ended, the counters and the report, where the tree
    sends a `CoreStep`), and the front end unpickling it and rebuilding the outputs (`front`). A tree
    from before engine/online/output_wire.py is measured as its core and client did it: every
    output in full."""
    import pickle
    from types import SimpleNamespace

    from engine.online.core_channel import frame

    def outputs(step: int) -> list[RequestOutput]:
        return [RequestOutput(f"cmpl-{i:032x}", None, [1] * 560, [CompletionOutput(0, "", [1000 + step], None)],
                              False, RequestMetrics(1.0, 1.5, 2.0, None, 0), 0, None) for i in range(streams)]

    try:
        from engine.online.engine_core import CoreStep
        from engine.online.engine_stats import EngineStats, RequestStats
        from engine.online.output_wire import OutputPacker, OutputReader
        from policies.routing.replica_report import ReplicaReport

        packer, reader = OutputPacker(), OutputReader()
        # The whole step's message: the outputs, a request that ended, the engine's counters and
        # the scheduler's report.
        ended = RequestStats("cmpl-ended", "length", 560, 600, 0.01, [0.002] * 4, 1.2, None, 1.0)
        stats, report = EngineStats(streams, 0, 0, 0.4, 0, 10**6, 10**5, 100, 1000), ReplicaReport(0, streams, 0, 900, 4096, 10**5, 16)
        pack_all = lambda outs: CoreStep({}, 0, [packer.pack(o) for o in outs], [ended], stats, report)
        read = lambda step: list(reader.read(step.outputs, step.finished))
    except ImportError:
        from engine.online.engine_core import pack, step_outputs

        seen: set[str] = set()
        prompts: dict = {}

        def pack_all(outs):
            packed = [pack(o, o.request_id not in seen) for o in outs]
            seen.update(o.request_id for o in outs)
            return packed

        def read(packed):
            return list(step_outputs(prompts, SimpleNamespace(outputs=packed, finished=[])))

    core, front = [], []
    for step in range(steps):
        outs = outputs(step)
        t0 = time.perf_counter()
        data = frame(pack_all(outs))
        t1 = time.perf_counter()
        read(pickle.loads(data[8:]))
        t2 = time.perf_counter()
        if step:  # the first step carries every prompt
            core.append(t1 - t0)
            front.append(t2 - t1)
    return {f"core_{streams}": core, f"front_{streams}": front}


def first_output(prompt_len: int, steps: int = 2000) -> dict[str, list[float]]:
    """Per request, a step message carrying its first output (a prompt of `prompt_len` token ids in
    Qwen3's vocabulary, sent as ids), with the counters and the report: the core packing and
    framing it (`core_first`), the front end unpickling it and rebuilding the output, told of the
    prompt first where the tree's reader is (`front_first`)."""
    import pickle
    import random

    from engine.online.core_channel import frame
    from engine.online.engine_core import CoreStep
    from engine.online.engine_stats import EngineStats
    from engine.online.output_wire import OutputPacker, OutputReader
    from policies.routing.replica_report import ReplicaReport

    rng = random.Random(0)
    packer, reader = OutputPacker(), OutputReader()
    told = getattr(reader, "sent", None)  # a tree whose front end keeps the prompts it sent
    stats, report = EngineStats(1, 0, 0, 0.4, 0, 10**6, 10**5, 100, 1000), ReplicaReport(0, 1, 0, 900, 4096, 10**5, 16)
    core, front = [], []
    for step in range(steps + 100):
        request_id = f"cmpl-{step:032x}"
        prompt = [rng.randrange(151936) for _ in range(prompt_len)]
        output = RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", [1000 + step], None)],
                               False, RequestMetrics(1.0, 1.5, 2.0, None, 0), 0, None)
        if told is not None:
            t_told = time.perf_counter()
            told(request_id, prompt)
            t_told = time.perf_counter() - t_told
        else:
            t_told = 0.0
        t0 = time.perf_counter()
        data = frame(CoreStep({}, 1, [packer.pack(output)], [], stats, report))
        t1 = time.perf_counter()
        message = pickle.loads(data[8:])
        got = list(reader.read(message.outputs, message.finished))
        t2 = time.perf_counter()
        assert got[0][0].prompt_token_ids == prompt
        packer._sent.clear()  # the request ends elsewhere: neither side keeps it
        reader._known.clear()
        if step >= 100:
            core.append(t1 - t0)
            front.append(t2 - t1 + t_told)
    return {"core_first": core, "front_first": front}


def first_among(streams: int, steps: int = 300) -> dict[str, list[float]]:
    """Per step, `streams` requests running (one token each) and a new request's first output last:
    the core's packing and framing of the step until the message with the new request's output is
    ready, plus the front end from the step's messages written to its pipe (all at once) to the new
    request's consumer holding its output."""
    import os

    from engine.online.async_llm_engine import AsyncLLMEngine
    from engine.online.core_channel import frame
    from engine.online.engine_core import CoreStep
    from engine.online.output_wire import OutputPacker
    from engine.online.process_host import ProcessHost
    from policies.request import SamplingParams
    from policies.routing.replica_report import ReplicaReport

    try:
        from engine.online.engine_core import _first_apart as first_apart
    except ImportError:  # a tree whose core sends each step's outputs in one message
        def first_apart(packer, outputs):
            return [outputs]

    client = StubCoreClient()
    host = ProcessHost(client)
    engine = AsyncLLMEngine(host)
    packer = OutputPacker()
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    prompt = [1] * 560
    stats, report = EngineStats(streams, 0, 0, 0.4, 0, 10**6, 10**5, 100, 1000), ReplicaReport(0, streams, 0, 900, 4096, 10**5, 16)

    def output(request_id: str, token: int) -> RequestOutput:
        return RequestOutput(request_id, None, prompt, [CompletionOutput(0, "", [token], None)], False,
                             RequestMetrics(1.0, 1.5, 2.0, None, 0), 0, None)

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        got = {"n": 0}
        all_read = asyncio.Event()

        async def running(request_id: str) -> None:
            async for _ in engine.generate(prompt, params, request_id, output_kind="delta"):
                got["n"] += 1
                if got["n"] == streams:
                    all_read.set()

        async def new(request_id: str, held: asyncio.Future) -> None:
            async for _ in engine.generate(prompt, params, request_id, output_kind="delta"):
                held.set_result(time.perf_counter())
                return

        tasks = [asyncio.ensure_future(running(f"s{i}")) for i in range(streams)]
        await asyncio.sleep(0)
        waits = []
        for step in range(steps + 20):
            held = loop.create_future()
            newcomer = asyncio.ensure_future(new(f"new{step}", held))
            await asyncio.sleep(0)
            got["n"] = 0
            all_read.clear()
            outs = [output(f"s{i}", 1000 + step) for i in range(streams)] + [output(f"new{step}", 7)]
            t0 = time.perf_counter()
            sent = []
            for part in first_apart(packer, outs):  # the new request's output is in the first message
                sent.append(frame(CoreStep({}, 1, [packer.pack(o) for o in part], [], stats, report)))
                if len(sent) == 1:
                    core = time.perf_counter() - t0
            t1 = time.perf_counter()
            os.write(client.core_fd, b"".join(sent))  # every message at once: one read brings them all
            t2 = await held
            await all_read.wait()
            await newcomer
            if step >= 20:  # the first steps carry every running stream's first output
                waits.append(core + t2 - t1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return waits

    return {f"first_among_{streams}": asyncio.run(main())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="frontend_cpu.json")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=560, help="token ids per prompt")
    ap.add_argument("--tokens", type=int, default=4, help="output tokens per request (one chunk each)")
    ap.add_argument("--wire", type=int, nargs="*", default=[10, 256],
                    help="also time the core's output messages per step with this many streams")
    a = ap.parse_args()
    result = asyncio.run(measure(a.prompt_len, a.tokens, a.requests))
    for streams in a.wire:
        result.update(wire(streams))
        result.update(first_among(streams))
    result.update(first_output(a.prompt_len))
    with open(a.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
