"""The FastAPI app of the OpenAI-compatible server: routes, and errors in OpenAI's shape.

`build_app(engine, served_model_name)` wraps an `AsyncLLMEngine`; the routes only translate OpenAI
requests into SamplingParams and engine outputs back into OpenAI responses (the scheduler does not
know a request came over HTTP). Every error is `{"error": {"message", "type", "param", "code"}}`
and leaves the server serving.
"""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.serving.chat import ChatTemplate, load_chat_template
from engine.serving.chat_completions import create_chat_completion
from engine.serving.completions import create_completion
from engine.serving.errors import APIError, bad_value, validation_error
from engine.serving.metrics import CONTENT_TYPE, ServingMetrics
from engine.serving.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from engine.tokenizer import encode_prompt

logger = logging.getLogger("engine.serving")


@dataclass(slots=True)
class ServingContext:
    """What the routes share: the engine and the facts about the model they check against."""

    engine: Any  # AsyncLLMEngine
    model_name: str  # the name clients send as `model`
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    chat: ChatTemplate
    metrics: ServingMetrics
    started: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model={model!r} does not exist: this server serves {self.model_name!r}",
                           "model")

    def created(self) -> int:
        return int(time.time())

    def encode(self, prompt: str | list[int], field_name: str) -> list[int]:
        """Token ids of one prompt; 400 naming the field for text without a tokenizer or bad ids."""
        if isinstance(prompt, str):
            try:
                return encode_prompt(self.tokenizer, prompt)
            except ValueError as exc:
                raise bad_value(exc) from None
        if not prompt:
            raise APIError(400, f"{field_name}=[] is invalid: a prompt needs at least one token", field_name)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{field_name}={bad[:5]} is invalid: token ids must be integers in "
                           f"[0, {self.vocab_size})", field_name)
        return prompt


def build_app(engine: Any, served_model_name: str | None = None, chat_template: str | None = None) -> FastAPI:
    """The app over an AsyncLLMEngine (its engine in a worker thread or in a core process)."""
    name = served_model_name or engine.model_name
    ctx = ServingContext(engine=engine, model_name=name, max_model_len=engine.max_model_len,
                         vocab_size=engine.vocab_size, tokenizer=engine.tokenizer,
                         chat=ChatTemplate(engine.tokenizer, load_chat_template(chat_template)),
                         metrics=ServingMetrics(engine.stats, name))
    engine.add_finished_observer(ctx.metrics.observe)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await engine.shutdown()

    app = FastAPI(title="servelab", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.ctx = ctx

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return APIError(503, f"the engine has stopped: {engine.dead_error}").response()
        try:
            await engine.check_health()
        except Exception as exc:  # noqa: BLE001 (any failure means unhealthy)
            return APIError(503, f"the engine is unhealthy: {exc}").response()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=ctx.model_name, created=ctx.started, root=engine.model_name,
                         max_model_len=ctx.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        return await create_completion(ctx, req, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: Request):
        return await create_chat_completion(ctx, req, http)

    return app
