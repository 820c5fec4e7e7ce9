"""Where a served request's time to its first token goes, hop by hop, on the server's clock.

`TimedApp(app)` wraps the server's ASGI app (what uvicorn calls) and notes, for each streamed
completion, when uvicorn handed the request to the app (its head parsed) and when the first chunk
with a choice was written to the socket, under the request id that chunk carries. With the
server's own `RequestStats` of the same requests (`arrival`: `generate()` called; `ttft`: from
there to the first token leaving its step in the engine, both `time.monotonic()`, one clock for
every process of the host), `hops` splits the server's part of each TTFT into

    way_in   the app's call to generate(): body read, parsed and checked, the engine request built
    engine   generate() to the first token leaving its step (the hand-off to the engine core, the
             wait for a step, the steps, the token's processing there)
    way_out  that token to its chunk written: the step's outputs packed and sent by the core, read
             by the front end, the stream's chunk built and written

and the client's TTFT less the three (`client_rest`: the client sending the request and reading
the chunk, and the transport both ways) where the client's rows are given.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

HOPS = ("way_in", "engine", "way_out")
_ID_AT = b'"id":'


class TimedApp:
    """An ASGI app that times its wrapped app's streamed completions (module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state  # the server's shutdown reads the app's state
        self.times: dict[str, tuple[float, float]] = {}  # request id -> (app called, first chunk written)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return
        called, done = time.monotonic(), False

        async def timed_send(message) -> None:
            nonlocal done
            await send(message)
            if not done and message["type"] == "http.response.body":
                body = message.get("body", b"")
                if b'"choices":[{' in body and _ID_AT in body:
                    done = True
                    self.times[_request_id(body)] = (called, time.monotonic())

        await self.app(scope, receive, timed_send)


def _request_id(chunk: bytes) -> str:
    """The `id` of an SSE chunk `data: {"id":"cmpl-...",...}`."""
    return json.loads(chunk[chunk.index(b"{"):].split(b"\n", 1)[0])["id"]


def hops(times: dict[str, tuple[float, float]], server: Iterable[Any]) -> pd.DataFrame:
    """One row per request both timed here and recorded by the server (`RequestStats` with an
    arrival and a first token): `request_id`, `prompt_len`, `output_len`, the HOPS and `server`
    (their sum: the app's call to the first chunk written), in seconds."""
    rows = []
    for s in server:
        t = times.get(s.request_id)
        if t is None or s.ttft is None or s.arrival is None:
            continue
        called, written = t
        rows.append({"request_id": s.request_id, "prompt_len": s.num_prompt_tokens,
                     "output_len": s.num_generation_tokens, "way_in": s.arrival - called, "engine": s.ttft,
                     "way_out": written - (s.arrival + s.ttft), "server": written - called})
    return pd.DataFrame(rows, columns=["request_id", "prompt_len", "output_len", *HOPS, "server"])


def with_client(timeline: pd.DataFrame, client_rows: pd.DataFrame) -> pd.DataFrame:
    """`timeline` with the client's TTFT (`client`) and `client_rest` = client - server, for the
    requests whose (prompt, output) lengths pair them unambiguously (as the serving calibration
    pairs them, experiments/lib/serving_calibration.py)."""
    done = client_rows[(client_rows["status"] == "finished") & client_rows["ttft"].notna()]
    keys = list(zip(done["prompt_len"].astype(int), done["output_len"].astype(int)))
    counts = Counter(keys)
    client = {k: t for k, t in zip(keys, done["ttft"].to_numpy(float)) if counts[k] == 1}
    ours = list(zip(timeline["prompt_len"].astype(int), timeline["output_len"].astype(int)))
    server_counts = Counter(ours)
    out = timeline.copy()
    out["client"] = [client.get(k) if server_counts[k] == 1 else None for k in ours]
    out = out[out["client"].notna()].copy()
    out["client"] = out["client"].astype(float)
    out["client_rest"] = out["client"] - out["server"]
    return out


def summary(timeline: pd.DataFrame) -> dict[str, Any]:
    """p50 and mean of each hop in ms, and the number of requests."""
    cols = [c for c in (*HOPS, "server", "client_rest", "client") if c in timeline]
    return {"requests": len(timeline),
            **{c: {"p50_ms": 1e3 * float(np.median(timeline[c])), "mean_ms": 1e3 * float(timeline[c].mean())}
               for c in cols if len(timeline)}}
