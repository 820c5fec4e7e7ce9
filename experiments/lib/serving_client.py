"""A workload sent to an OpenAI-compatible server, timed on the client (vLLM's benchmark_serving).

Each request goes out at its arrival time (bounded: at most `max_concurrency` in flight, at most
`max_request_rate` sends per second) as a streaming `POST /v1/completions` with the workload's
token-id prompt, `max_tokens` = its output length, `ignore_eos`, its temperature and priority, and
`stream_options.include_usage`. Times are `time.perf_counter()` relative to the run's start: arrival
= when the request was sent, first token = the first chunk that carries a choice, token times = one
per such chunk (so ITL = gaps between chunks, as vLLM's benchmark defines it), finish = `data:
[DONE]` (or the end of the stream without it); output length = the usage block's completion_tokens
(the number of chunks without one). Each response is read to its end, after [DONE] too, as OpenAI's
client reads it, so its keep-alive connection serves the next request.
Rows are `policies.trace.REQUEST_COLUMNS` rows (the scheduler-only columns, first scheduled time
and preemptions, stay empty), so `experiments.lib.metrics.summarize` computes every metric.
Only loopback servers are driven.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from experiments.lib.workloads import Workload
from policies.trace import request_row

LOOPBACK_NAMES = ("localhost",)
DRAIN_S = 5.0  # the longest a response's end is awaited after `data: [DONE]`
MODELS_TIMEOUT_S = 30.0  # the longest GET /v1/models is awaited
# HTTP statuses of a server without the endpoint (not found, not allowed, no POST); a 404 whose body
# is an OpenAI error (vLLM's and engine.serve's answer to an unknown `model`) is the server refusing
# the model instead.
NO_ENDPOINT = (404, 405, 501)


@dataclass(slots=True)
class ClientConfig:
    url: str  # the server's base URL (http://127.0.0.1:8000; a trailing /v1 is accepted)
    model: str | None = None  # the `model` to send; None: the first of GET /v1/models
    max_concurrency: int = 1024
    max_request_rate: float = 10000.0  # sends per second, at most
    timeout_s: float = 3600.0  # per request

    def __post_init__(self) -> None:
        self.url = check_loopback(self.url)
        if isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int) \
                or self.max_concurrency < 1:
            raise ValueError(f"backend.max_concurrency={self.max_concurrency!r} is invalid: an integer >= 1")
        if not isinstance(self.max_request_rate, (int, float)) or not self.max_request_rate > 0:
            raise ValueError(f"backend.max_request_rate={self.max_request_rate!r} is invalid: a number > 0")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"backend.timeout_s={self.timeout_s!r} is invalid: a number > 0 (seconds)")


def check_loopback(url: str) -> str:
    """The base URL without a trailing `/` or `/v1`; ValueError unless it is http(s) on loopback."""
    parts = urlsplit(str(url))
    host = parts.hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host in LOOPBACK_NAMES
    if parts.scheme not in ("http", "https") or not loopback:
        raise ValueError(f"backend.url={url!r} is invalid: the benchmark only drives servers on the loopback "
                         "address (http://127.0.0.1:PORT)")
    base = f"{parts.scheme}://{parts.netloc}{parts.path}".rstrip("/")
    return base.removesuffix("/v1")


@dataclass(slots=True)
class _Timing:
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    num_chunks: int = 0
    usage_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    refused: BaseException | None = None  # no connection to the server at all
    no_endpoint: str | None = None  # the server has no POST /v1/completions: its answer
    unknown_model: str | None = None  # the server's message of a 404 in OpenAI's error shape


def _what_to_do(base: str) -> str:
    port = urlsplit(base).port or 8000
    return (f"start one (python -m engine.serve --model MODEL --port {port}) or point backend.url at an "
            "OpenAI-compatible server")


def unreachable(base: str, exc: BaseException) -> ValueError:
    """Nothing answers at `base` (connection refused, reset, timed out): the error to stop the run with."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        reason = exc.os_error.strerror or str(exc.os_error) or type(exc.os_error).__name__
    elif isinstance(exc, TimeoutError):
        reason = "no answer in time"
    else:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ValueError(f"backend.url={base!r} is invalid: no server answers there ({reason}): {_what_to_do(base)}")


def openai_error(body: str) -> str | None:
    """The message of an OpenAI error body (`{"error": {"message": ...}}`, or vLLM's older
    `{"object": "error", "message": ...}`); None for any other body."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("error"), dict):
        err = data["error"]
    elif data.get("object") == "error":
        err = data
    else:
        return None
    message = err.get("message")
    return str(message) if message is not None else json.dumps(err)


def excerpt(body: str, limit: int = 120) -> str:
    """A response body shortened for one line: tags dropped, whitespace collapsed, at most `limit` characters."""
    text = " ".join(re.sub(r"<[^>]*>", " ", body).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


async def _first_model(session: Any, base: str) -> str:
    """The first model of the server's GET /v1/models; a ValueError naming the URL when nothing
    answers there or what answers is no OpenAI-compatible server."""
    url = f"{base}/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as resp:
            status, body = resp.status, await resp.text(errors="replace")
    except (TimeoutError, OSError, aiohttp.ClientError) as exc:
        raise unreachable(base, exc) from None
    try:
        data = json.loads(body)["data"] if status == 200 else None
        model = data[0]["id"] if data else None
    except (ValueError, TypeError, KeyError, IndexError):
        data = model = None
    if status != 200 or not isinstance(model, str):
        answer = f"HTTP {status}" if status != 200 else ("no model" if data == [] else "no OpenAI model list")
        raise ValueError(f"backend.url={base!r} is invalid: GET {url} answered {answer} ({excerpt(body)!r}): "
                         f"{_what_to_do(base)}, or set backend.model")
    return model


async def _one(session: Any, base: str, body: dict[str, Any], t0: float, timing: _Timing,
               token_times: list[float]) -> None:
    perf = time.perf_counter
    try:
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            if resp.status != 200:
                body = await resp.text(errors="replace")
                message = openai_error(body)
                timing.error = f"HTTP {resp.status}: {excerpt(body if message is None else message, 300)}"
                if resp.status == 404 and message is not None:  # the endpoint is there; the model is not
                    timing.unknown_model = excerpt(message, 200)
                elif resp.status in NO_ENDPOINT:
                    timing.no_endpoint = f"HTTP {resp.status} ({excerpt(body)!r})"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    timing.finish = perf() - t0
                    # The rest of the response (its chunked body's end) read, as OpenAI's client
                    # reads it: a response left unread closes its connection, and the next request
                    # would pay for a new one on its way to its first token.
                    try:
                        await asyncio.wait_for(resp.content.read(), DRAIN_S)
                    except TimeoutError:  # a server that holds the body open: its connection is dropped
                        pass
                    return
                now = perf() - t0
                data = json.loads(payload)
                if "error" in data:
                    timing.error = str(data["error"].get("message", data["error"]))[:300]
                    continue
                choices = data.get("choices")
                if choices:
                    timing.num_chunks += 1
                    token_times.append(now)
                    if timing.first_token is None:
                        timing.first_token = now
                    reason = choices[0].get("finish_reason")
                    if reason is not None:
                        timing.finish_reason = reason
                if data.get("usage"):
                    timing.usage_tokens = int(data["usage"]["completion_tokens"])
    except (TimeoutError, OSError, aiohttp.ClientError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, aiohttp.ClientConnectorError):
            timing.refused = exc
    finally:
        if timing.finish is None:
            timing.finish = perf() - t0


async def drive(workload: Workload, cfg: ClientConfig, on_done: Callable[[int], None] = lambda n: None
                ) -> tuple[list[dict], dict[str, Any]]:
    """Send every request of `workload`; return its REQUEST_COLUMNS rows (in end order) and run info."""
    conn = aiohttp.TCPConnector(limit=cfg.max_concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    rows: list[dict] = []
    errors: list[str] = []
    refused: list[BaseException] = []
    no_endpoint: list[str] = []  # the answers to requests the server had no endpoint for
    unknown_model: list[str] = []  # the server's messages refusing the model with a 404
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        model = cfg.model or await _first_model(session, cfg.url)
        slots = asyncio.Semaphore(cfg.max_concurrency)
        gap = 1.0 / cfg.max_request_rate
        t0 = time.perf_counter()
        next_send = 0.0

        async def request(i: int, send_at: float) -> None:
            r, out_len = workload.requests[i], workload.output_lens[i]
            delay = send_at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots:
                sp = r.sampling_params
                body = {"model": model, "prompt": r.prompt_token_ids, "max_tokens": out_len,
                        "temperature": sp.temperature, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                if r.priority:
                    body["priority"] = r.priority
                if r.tenant is not None:
                    body["user"] = r.tenant  # OpenAI's end-user id: the server's tenant
                timing, token_times = _Timing(arrival=time.perf_counter() - t0), []
                await _one(session, cfg.url, body, t0, timing, token_times)
            rows.append(_row(r.request_id, r.priority, r.num_prompt_tokens, sp.n, timing, token_times, r.tenant))
            if timing.error is not None:
                errors.append(f"request {r.request_id}: {timing.error}")
            if timing.refused is not None:
                refused.append(timing.refused)
            if timing.no_endpoint is not None:
                no_endpoint.append(timing.no_endpoint)
            if timing.unknown_model is not None:
                unknown_model.append(timing.unknown_model)
            on_done(1)

        tasks = []
        for i, r in enumerate(workload.requests):
            next_send = max(r.arrival_time, next_send)
            tasks.append(asyncio.ensure_future(request(i, next_send)))
            next_send += gap
        await asyncio.gather(*tasks)
    if rows and len(refused) == len(rows):  # not one request reached a server: no run to report
        raise unreachable(cfg.url, refused[0])
    if rows and len(no_endpoint) == len(rows):  # no completions endpoint there: no run to report
        raise ValueError(f"backend.url={cfg.url!r} is invalid: POST {cfg.url}/v1/completions answered "
                         f"{no_endpoint[0]}: {_what_to_do(cfg.url)}")
    if rows and len(unknown_model) == len(rows):  # the server does not serve the model sent
        given = "" if cfg.model else " (the first of GET /v1/models)"
        raise ValueError(f"backend.model={model!r}{given} is invalid: POST {cfg.url}/v1/completions answered "
                         f"HTTP 404 ({unknown_model[0]!r}): check backend.model; GET {cfg.url}/v1/models lists "
                         "the models this server serves")
    return rows, {"url": cfg.url, "served_model": model, "max_concurrency": cfg.max_concurrency,
                  "max_request_rate": cfg.max_request_rate,
                  "failed": sum(1 for row in rows if row["status"] != "finished"), "errors": errors[:5]}


def _row(request_id: str, priority: int, prompt_len: int, n: int, t: _Timing, token_times: list[float],
         tenant: str | None = None) -> dict:
    output_len = t.usage_tokens if t.usage_tokens is not None else t.num_chunks
    if t.error is not None:
        status, reason = "aborted", "abort:client_error"
    elif t.finish_reason in ("stop", "length"):
        status, reason = "finished", t.finish_reason
    else:
        status, reason = "aborted", f"abort:{t.finish_reason or 'no_finish_reason'}"
    return request_row(request_id, t.arrival, priority, prompt_len, output_len, n, None, t.first_token,
                       t.finish, status, reason, token_times, output_len, tenant=tenant)
