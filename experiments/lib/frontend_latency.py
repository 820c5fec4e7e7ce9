"""Where the time to the first token goes between an HTTP client and the engine, layer by layer.

`python frontend_latency.py --out FILE [--requests N]` (a copy of this file outside any package, run
with PYTHONPATH at the tree to measure: `experiments.bench_frontend --latency` runs it for this tree
and for a baseline commit, so it imports only the engine's public API and the benchmark client)
times one request at a time, each sent when the last one ended (an idle server, as TTFT at low
load sees it), through every layer:

    engine          LLMEngine.add_request -> the step that returns its first token (in-process TTFT)
    async_thread    AsyncLLMEngine.generate -> first output, engine in a worker thread
    async_process   the same, engine in its own process (engine.serve's default)
    http_raw        POST /v1/completions (stream) -> first SSE chunk with a choice, from a raw-socket
                    client (keep-alive), engine in its own process
    http_aiohttp    the same from experiments.bench_serving's client (aiohttp), the tree's own
    http_openai     the same from OpenAI's official client (`openai.AsyncOpenAI`, its connection kept),
                    the prompt's ids given as `prompt` (the client walks every id against its types
                    first, ~30 us an id: milliseconds before a long prompt leaves)
    http_openai_body  the same with the ids sent through `extra_body` (no walk): what the client's
                    transport and SSE parsing add
    http_h11        http_raw with uvicorn on plain asyncio + h11 (what uvicorn falls back to where
                    uvloop and httptools are not installed)
    http_thread     http_raw with the engine in a worker thread of the server

and, with `--background K`, while K other clients stream (150 tokens each, one after another):
`http_loaded` and `http_h11_loaded`, http_raw's requests among them, and the front end's CPU time
per streamed chunk (µs of the server process: the work a busy front end queues a request behind).
`<path>_own` beside an HTTP path: the server's own TTFT of the same requests (its `RequestStats`:
from `generate()` to the token in the engine), so the client's TTFT minus it is the request's way
in before `generate()` plus the first output's way back (SSE, socket, client).
Writes {path: [seconds, ...], "frontend_us_per_chunk": {...}} as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import resource
import subprocess
import sys
import time

PROMPT = list(range(1, 33))
# OpenAI's client where installed (the `dev` extra): the client whose TTFT the server's figures answer to.
OPENAI = ["openai", "openai_body"] if importlib.util.find_spec("openai") is not None else []  # token ids 1..n (`--prompt-len n`, cycling below tiny-llama's vocabulary)


def set_prompt_len(n: int) -> None:
    """Every path's prompt (BODY shares the list) becomes n token ids."""
    PROMPT[:] = [1 + i % 250 for i in range(n)]

BODY = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}


# ---- clients (run in a subprocess: `--client KIND --port P`) ---------------------------------------
async def raw_client(port: int, n: int) -> list[float]:
    """HTTP/1.1 keep-alive over a bare socket: the least a client can add."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(BODY).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(data)}\r\n\r\n").encode() + data
    times = []
    for _ in range(n):
        t0, first = time.perf_counter(), None
        writer.write(request)
        await reader.readuntil(b"\r\n\r\n")  # status line and headers (chunked body follows)
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            if first is None and b'"choices":[{' in chunk:
                first = time.perf_counter() - t0
        times.append(first)
    writer.close()
    return times


async def aiohttp_client(port: int, n: int) -> list[float]:
    """The tree's own benchmark client (experiments.bench_serving's request, timed as it times it)."""
    import aiohttp

    from experiments.lib.serving_client import _one, _Timing

    times = []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            timing = _Timing(arrival=0.0)
            await _one(session, f"http://127.0.0.1:{port}", BODY, time.perf_counter(), timing, [])
            times.append(timing.first_token)
    return times


async def openai_client(port: int, n: int, ids_in_body: bool = False) -> list[float]:
    """OpenAI's own client, timed as a user of it would: the call to the first chunk with a choice."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    prompt, extra = ("", {"prompt": PROMPT, "ignore_eos": True}) if ids_in_body else (PROMPT, {"ignore_eos": True})
    times = []
    for _ in range(n):
        t0, first = time.perf_counter(), None
        stream = await client.completions.create(model=BODY["model"], prompt=prompt, max_tokens=BODY["max_tokens"],
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra)
        async for chunk in stream:
            if first is None and chunk.choices:
                first = time.perf_counter() - t0
        times.append(first)
    await client.close()
    return times


async def background_client(port: int, k: int, seconds: float) -> int:
    """k streams of 150 tokens each, one after another, for `seconds`; the chunks received."""
    import aiohttp

    body = {**BODY, "max_tokens": 150}
    body.pop("stream_options")
    loop = asyncio.get_running_loop()
    end, chunks = loop.time() + seconds, 0
    async with aiohttp.ClientSession() as session:
        async def stream() -> None:
            nonlocal chunks
            while loop.time() < end:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    async for line in resp.content:
                        chunks += line.startswith(b"data: {")
        await asyncio.gather(*(stream() for _ in range(k)))
    return chunks


def run_client(kind: str, port: int, n: int) -> list[float]:
    out = subprocess.run([sys.executable, __file__, "--client", kind, "--port", str(port), "--requests", str(n),
                          "--prompt-len", str(len(PROMPT))], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


# ---- the paths --------------------------------------------------------------------------------------
def engine_args():
    from engine.engine_args import EngineArgs

    return EngineArgs(model="tiny-llama", device="cpu", num_gpu_blocks=1024, max_model_len=max(256, len(PROMPT) + 200))


def in_process(n: int) -> list[float]:
    from engine.offline.llm_engine import LLMEngine
    from policies.request import SamplingParams

    engine, params, times = LLMEngine(engine_args()), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), []
    for i in range(n):
        t0 = time.perf_counter()
        engine.add_request(f"r{i}", PROMPT, params)
        while not any(o.outputs and o.outputs[0].token_ids for o in engine.step()):
            pass
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    engine.close()
    return times


def through_async(engine, n: int) -> list[float]:
    from policies.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def main() -> list[float]:
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            stream = engine.generate(PROMPT, params, f"a{i}")
            await anext(stream)
            times.append(time.perf_counter() - t0)
            async for _ in stream:
                pass
        await engine.shutdown()
        return times

    return asyncio.run(main())


def through_http(engine, clients: list[str], n: int, plain_asyncio: bool = False,
                 background: int = 0) -> dict[str, list[float] | float]:
    import uvicorn

    from engine.serving.app import build_app
    from engine.serving.server import ServerThread

    if plain_asyncio:  # uvicorn without uvloop and httptools
        init = uvicorn.Config.__init__
        uvicorn.Config.__init__ = lambda self, *a, **kw: init(self, *a, **{**kw, "loop": "asyncio", "http": "h11"})
    own: list[float] = []  # the server's own TTFT of each single request (generate() -> token in the engine)
    app = build_app(engine, "tiny-llama")
    engine.add_finished_observer(lambda r: own.append(r.ttft) if r.num_generation_tokens == BODY["max_tokens"] else None)
    try:
        with ServerThread(app) as server:
            result: dict[str, list[float] | float] = {}
            for kind in clients:
                own.clear()
                result[kind] = run_client(kind, server.port, n)
                result[f"{kind}_own"] = list(own)
            if background:  # K streams for 6 s; single requests among them from the second on
                cpu0 = resource.getrusage(resource.RUSAGE_SELF)
                streams = subprocess.Popen([sys.executable, __file__, "--client", "background", "--port",
                                            str(server.port), "--requests", str(background),
                                            "--prompt-len", str(len(PROMPT))],
                                           stdout=subprocess.PIPE, text=True)
                time.sleep(1.0)
                own.clear()
                result["loaded"] = run_client("raw", server.port, n)
                result["loaded_own"] = list(own)
                chunks = json.loads(streams.communicate()[0])
                cpu1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
                result["us_per_chunk"] = 1e6 * cpu / max(chunks, 1)
    finally:
        if plain_asyncio:
            uvicorn.Config.__init__ = init
    return result


def measure(n: int, background: int) -> dict:
    from engine.offline.llm_engine import LLMEngine
    from engine.online.async_llm_engine import AsyncLLMEngine

    def process_engine():
        return AsyncLLMEngine.from_engine_args(engine_args(), engine_process=True)

    warm = 10  # dropped: first requests of each path (allocator, caches)
    out: dict = {"engine": in_process(n + warm)[warm:]}
    out["async_thread"] = through_async(AsyncLLMEngine(LLMEngine(engine_args())), n + warm)[warm:]
    out["async_process"] = through_async(process_engine(), n + warm)[warm:]
    chunk_cost = {}
    for name, engine, asyncio_h11 in (("http", process_engine(), False), ("http_h11", process_engine(), True),
                                      ("http_thread", AsyncLLMEngine(LLMEngine(engine_args())), False)):
        clients = ["raw", "aiohttp", *OPENAI] if name == "http" else ["raw"]
        got = through_http(engine, clients, n + warm, asyncio_h11, background)
        for kind in clients:
            key = f"{name}_{kind}" if name == "http" else name
            out[key] = got[kind][warm:]
            out[f"{key}_own"] = got[f"{kind}_own"][warm:]
        if background and name != "http_thread":  # there the process steps the engine too
            chunk_cost[name] = got["us_per_chunk"]
            out[f"{name}_loaded"] = got["loaded"][warm:]
            out[f"{name}_loaded_own"] = got["loaded_own"][warm:]
    if chunk_cost:
        out["frontend_us_per_chunk"] = chunk_cost
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="frontend_latency.json")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--background", type=int, default=0, help="streams for the per-chunk cost (0: skip)")
    ap.add_argument("--client", choices=["raw", "aiohttp", "openai", "openai_body", "background"], default=None)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=32, help="token ids per prompt (tiny-llama: up to 1,800)")
    a = ap.parse_args()
    set_prompt_len(a.prompt_len)
    if a.client == "background":
        print(json.dumps(asyncio.run(background_client(a.port, a.requests, 6.0))))
    elif a.client is not None:
        clients = {"raw": raw_client, "aiohttp": aiohttp_client, "openai": openai_client,
                   "openai_body": lambda port, n: openai_client(port, n, ids_in_body=True)}
        print(json.dumps(asyncio.run(clients[a.client](a.port, a.requests))))
    else:
        with open(a.out, "w") as f:
            json.dump(measure(a.requests, a.background), f)


if __name__ == "__main__":
    main()
