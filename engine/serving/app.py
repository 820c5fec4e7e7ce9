"""The FastAPI app of the OpenAI-compatible server: routes, and errors in OpenAI's shape.

`build_app(engine, served_model_name)` wraps an `AsyncLLMEngine`; the routes only translate OpenAI
requests into SamplingParams and engine outputs back into OpenAI responses (the scheduler does not
know a request came over HTTP). Every error is `{"error": {"message", "type", "param", "code"}}`
with a short message (details and tracebacks go to the log) and leaves the server serving.
`served_model_name`: one name or several (vLLM's --served-model-name): the API reports the first
and accepts each as `model`. Requests pass engine/serving/guards.py first (API key, body size).
Text longer than OFFLOAD_CHARS is tokenized (chat: templated and tokenized) in a worker thread,
so a huge prompt never stalls the event loop that streams every other response.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.offline.outputs import short_error
from engine.offline.tokenizer import encode_prompt
from engine.serving.chat import ChatTemplate, load_chat_template
from engine.serving.chat_completions import create_chat_completion
from engine.serving.completions import create_completion
from engine.serving.errors import APIError, bad_value, field_param, parse_request
from engine.serving.guards import RequestGuard, default_max_body_bytes
from engine.serving.metrics import CONTENT_TYPE, ServingMetrics
from engine.serving.protocol import ChatCompletionRequest, CompletionRequest
from engine.serving.responses import ModelCard, ModelList
from engine.serving.routes_ahead import ServingApp

logger = logging.getLogger("engine.serving")
OFFLOAD_CHARS = 2048  # longer text is tokenized in a worker thread (shorter: at once, no thread hop)
TOKENIZER_THREADS = 2
T = TypeVar("T")


@dataclass(slots=True)
class ServingContext:
    """What the routes share: the engine and the facts about the model they check against."""

    engine: Any  # AsyncLLMEngine
    model_names: tuple[str, ...]  # the names clients may send as `model`; the first is reported
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    tokenizer: Any
    chat: ChatTemplate
    metrics: ServingMetrics
    started: int = field(default_factory=lambda: int(time.time()))
    tokenizer_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        TOKENIZER_THREADS, thread_name_prefix="servelab-tokenizer"))

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            served = self.model_names[0] if len(self.model_names) == 1 else list(self.model_names)
            raise APIError(404, f"model={model!r} does not exist: this server serves {served!r}", "model")

    def created(self) -> int:
        return int(time.time())

    async def off_loop(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a tokenizer thread when `size` (characters) is over OFFLOAD_CHARS, else here."""
        if size <= OFFLOAD_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """Token ids of the templated messages (the template's role markers and special tokens count)."""
        size = sum(len(v) for m in messages for v in m.values() if isinstance(v, str))
        return await self.off_loop(size, self.chat.encode, messages, add_generation_prompt)

    async def encode(self, prompt: str | list[int], field_name: str) -> list[int]:
        """Token ids of one prompt; 400 for text that encodes to no tokens, text without a tokenizer
        or bad ids, its message naming `field_name` (`prompt`, or `prompt[i]` in a list of prompts).
        Empty text is judged by its tokens, as vLLM does: a tokenizer that adds BOS encodes "" to
        [bos], which is served; one that adds nothing leaves no tokens, which is refused."""
        param = field_param(field_name)
        if isinstance(prompt, str):
            ids = await self.off_loop(len(prompt), self._encode_text, prompt, field_name)
            if not ids:
                raise APIError(400, f"{field_name}={prompt[:40]!r} is invalid: the text encodes to no tokens", param)
            return ids
        return self._check_ids(prompt, field_name, param)

    def _encode_text(self, prompt: str, field_name: str) -> list[int]:
        try:
            return encode_prompt(self.tokenizer, prompt)
        except ValueError as exc:
            raise bad_value(exc, {"prompt": field_name}) from None

    def _check_ids(self, prompt: list[int], field_name: str, param: str) -> list[int]:
        if not prompt:
            raise APIError(400, f"{field_name}=[] is invalid: a prompt needs at least one token", param)
        if min(prompt) >= 0 and max(prompt) < self.vocab_size:  # two passes in C: the common case
            return prompt
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{field_name}={bad[:5]} is invalid: token ids must be integers in "
                           f"[0, {self.vocab_size})", param)
        return prompt


def build_app(engine: Any, served_model_name: str | Sequence[str] | None = None, chat_template: str | None = None,
              *, api_keys: Sequence[str] = (), max_request_body_bytes: int | None = None) -> ServingApp:
    """The app over an AsyncLLMEngine (its engine in a worker thread or in a core process), behind
    its guards: `api_keys` (none: no authentication), `max_request_body_bytes` (None: a cap that
    admits a prompt of max_model_len tokens). `.state.ctx` is the routes' ServingContext."""
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name or ())
    if any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"served_model_name={served_model_name!r} is invalid: non-empty names")
    names = names or (engine.model_name,)
    ctx = ServingContext(engine=engine, model_names=names, max_model_len=engine.max_model_len,
                         vocab_size=engine.vocab_size, max_logprobs=engine.max_logprobs, tokenizer=engine.tokenizer,
                         chat=ChatTemplate(engine.tokenizer, load_chat_template(chat_template)),
                         metrics=ServingMetrics(engine.stats, names[0], engine.replica_status))
    engine.add_finished_observer(ctx.metrics.observe)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await engine.shutdown()
        ctx.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = ServingApp(title="servelab", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.ctx = ctx
    # Called by the server as it starts to shut down: open streams end with an error event and
    # [DONE] at once, so connections close and nothing waits for the graceful-shutdown timeout.
    app.state.end_streams = lambda: engine.end_streams("the server is shutting down")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.error("request failed", exc_info=exc)
        return APIError(500, "internal server error (the server's log has the details)").response()

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return APIError(503, f"the engine has stopped: {short_error(engine.dead_error)}").response()
        try:
            await engine.check_health()
        except Exception as exc:  # noqa: BLE001 (any failure means unhealthy)
            return APIError(503, f"the engine is unhealthy: {short_error(exc)}").response()
        detail = engine.health_detail()  # data-parallel replicas: each one's state
        return Response(status_code=200) if detail is None else JSONResponse(detail)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=name, created=ctx.started, root=engine.model_name, max_model_len=ctx.max_model_len)
                 for name in ctx.model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    # The generation routes are plain starlette routes whose bodies are parsed here
    # (engine/serving/errors.py: parse_request): one pass of pydantic's JSON validator, instead of
    # FastAPI's json.loads, validation and dependency solving on every request's way to its first token.
    # They are dispatched ahead of the router and FastAPI's own layers (engine/serving/routes_ahead.py).
    async def completions(http: Request) -> Response:
        return await create_completion(ctx, parse_request(await http.body(), CompletionRequest), http)

    async def chat_completions(http: Request) -> Response:
        return await create_chat_completion(ctx, parse_request(await http.body(), ChatCompletionRequest), http)

    app.route_ahead("/v1/completions", completions)
    app.route_ahead("/v1/chat/completions", chat_completions)

    cap = default_max_body_bytes(ctx.max_model_len) if max_request_body_bytes is None else max_request_body_bytes
    RequestGuard(app, cap, api_keys)  # the values checked now, not at the first request
    app.add_middleware(RequestGuard, max_body_bytes=cap, api_keys=api_keys)
    return app
