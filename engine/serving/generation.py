"""One HTTP request's generation: its prompts checked and sent to the AsyncLLMEngine, their outputs
merged into one stream, the client watched so that a disconnect aborts every sub-request.

A completion request with several prompts becomes one engine request per prompt (`<id>-<i>`), as
in vLLM; choice index = prompt index * n + sample index. `start()` submits every prompt and waits
for each one's first output, so an error the engine raises on admission (a bad value, a full
queue, a dead engine) becomes the HTTP status of the response instead of an error inside a
stream that has already said 200.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HTTPRequest

from engine.offline.outputs import CompletionOutput, RequestFailedError, RequestOutput
from engine.online.async_llm_engine import EngineDeadError, EngineQueueFullError
from engine.serving.errors import APIError, bad_value, field_param
from engine.serving.protocol import SamplingFields
from engine.serving.responses import PromptTokensDetails, UsageInfo
from engine.serving.sse import event
from policies.request import SamplingParams

_log = logging.getLogger("engine.serving")


@dataclass(slots=True)
class SubRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def sampling_params(fields: SamplingFields, prompt_len: int, max_model_len: int, max_tokens: int | None,
                    logprobs: int | None, prompt_field: str, renames: dict[str, str],
                    max_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams for one prompt; 400 naming the field when the prompt or a value is out of range.
    max_tokens None: up to max_model_len. `renames`: SamplingParams' field -> the request's name.
    `max_logprobs`: the most top logprobs a request may ask for (the engine's)."""
    if max_logprobs is not None and isinstance(logprobs, int) and logprobs > max_logprobs:
        name = renames.get("logprobs", "logprobs")
        raise APIError(400, f"{name}={logprobs} is invalid: this server returns at most {max_logprobs} "
                       "top logprobs per token (max_logprobs)", name)
    if prompt_len > max_model_len:
        raise APIError(400, f"{prompt_field} is {prompt_len} tokens long: more than this model's "
                       f"max_model_len={max_model_len}", field_param(prompt_field))
    max_field = renames.get("max_tokens", "max_tokens")
    if max_tokens is None:
        max_tokens = max(max_model_len - prompt_len, 1)
    elif isinstance(max_tokens, int) and max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"{max_field}={max_tokens} is invalid: the prompt ({prompt_len} tokens) plus "
                       f"{max_field} exceeds max_model_len={max_model_len}", max_field)
    try:
        # Delta outputs, as `Generation` asks for them: built so once, not copied again in generate().
        return SamplingParams(**fields.sampling_kwargs(max_tokens, logprobs), output_kind="delta")
    except (TypeError, ValueError) as exc:
        raise bad_value(ValueError(str(exc)), renames) from None


def engine_errors(exc: BaseException) -> APIError | None:
    """The HTTP error for an exception the engine raised while admitting or running a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineQueueFullError):
        return APIError(503, str(exc) or "the server's request queue is full: retry later")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc))
    if isinstance(exc, ValueError):
        return bad_value(exc)
    return None


def error_event(exc: Exception) -> str:
    """A streamed response's error (its status line is sent already) as an SSE event; an unexpected
    exception is logged with its traceback and named only by a short message."""
    err = engine_errors(exc)
    if err is None:
        _log.error("a stream failed", exc_info=exc)
        err = APIError(500, "generation failed: internal server error (the server's log has the details)")
    return event(err.body())


def has_news(c: CompletionOutput) -> bool:
    """A delta output worth a chunk: tokens, text or its end."""
    return bool(c.token_ids or c.text or c.finish_reason is not None)


def finish_reason(reason: str | None) -> str | None:
    """The engine's "abort:<why>" is vLLM's "abort"; "stop" and "length" stay."""
    if reason is not None and reason.startswith("abort"):
        return "abort"
    return reason


@dataclass(slots=True)
class Generation:
    engine: Any  # AsyncLLMEngine
    subs: list[SubRequest]
    http: HTTPRequest
    priority: int
    tenant: str | None = None  # the body's `user`: the client the request is served for
    finished: set[str] = field(default_factory=set)
    num_completion_tokens: int = 0  # over the outputs `outputs()` has yielded so far
    cached_tokens: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens from the prefix cache
    _gens: list[AsyncIterator[RequestOutput]] = field(default_factory=list)
    _first: list[RequestOutput] = field(default_factory=list)
    _watcher: asyncio.Task | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(s.prompt_token_ids) for s in self.subs)

    async def start(self) -> None:
        """Submit every prompt; wait for each one's first output. Raises APIError (after aborting
        the others) if the engine refuses one."""
        self._watcher = asyncio.ensure_future(self._watch_disconnect())
        self._gens = [self.engine.generate(s.prompt_token_ids, s.params, s.request_id, priority=self.priority,
                                           output_kind="delta", tenant=self.tenant) for s in self.subs]
        if len(self._gens) == 1:  # awaited here: no task and no extra loop iteration before the first token
            try:
                done = [await anext(self._gens[0])]
            except Exception as exc:  # noqa: BLE001 (handled below, as gather's results)
                done = [exc]
        else:
            firsts = [asyncio.ensure_future(anext(g)) for g in self._gens]
            done = await asyncio.gather(*firsts, return_exceptions=True)
        errors = [r for r in done if isinstance(r, BaseException)]
        if errors:
            await self.close()
            for exc in errors:
                if isinstance(exc, StopAsyncIteration):
                    continue
                err = engine_errors(exc)
                if err is None:
                    raise exc
                raise err
            raise APIError(500, "the engine ended a request without any output")
        self._first = list(done)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta RequestOutput) as they come; every sub-request ends finished or aborted."""
        try:
            for i, out in enumerate(self._first):
                yield i, self._seen(out)
            if len(self._gens) == 1:
                if not self._first[0].finished:
                    async for out in self._gens[0]:
                        yield 0, self._seen(out)
            else:
                async for i, out in self._merged():
                    yield i, self._seen(out)
        finally:
            await self.close()

    async def collect(self, samples_per_prompt: int) -> dict[int, CompletionOutput]:
        """Every choice's whole output (choice index = prompt index * n + sample index), read to the
        end of the stream; a choice the engine ended without a reason counts as "abort". Engine errors
        become HTTP errors."""
        texts: dict[int, list[str]] = {}
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list[dict]] = {}
        ends: dict[int, tuple[str | None, Any]] = {}
        try:
            async for i, out in self.outputs():
                for c in out.outputs:
                    index = i * samples_per_prompt + c.index
                    texts.setdefault(index, []).append(c.text)
                    tokens.setdefault(index, []).extend(c.token_ids)
                    if c.logprobs is not None:
                        logprobs.setdefault(index, []).extend(c.logprobs)
                    if c.finish_reason is not None:
                        ends[index] = (finish_reason(c.finish_reason), c.stop_reason)
        except Exception as exc:  # noqa: BLE001 (engine errors become HTTP errors; others re-raised)
            raise engine_errors(exc) or exc from None
        return {index: CompletionOutput(index, "".join(texts[index]), tokens[index],
                                        *ends.get(index, ("abort", None)), logprobs.get(index))
                for index in sorted(tokens)}

    def token_usage(self) -> UsageInfo:
        """Prompt and completion tokens so far (the whole response's once `outputs()` is done)."""
        return usage(self.num_prompt_tokens, self.num_completion_tokens, sum(self.cached_tokens.values()))

    def _seen(self, out: RequestOutput) -> RequestOutput:
        self.num_completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if out.num_cached_tokens:
            self.cached_tokens[out.request_id] = out.num_cached_tokens
        if out.finished:
            self.finished.add(out.request_id)
        return out

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()
        live = [i for i, first in enumerate(self._first) if not first.finished]

        async def pump(i: int) -> None:
            try:
                async for out in self._gens[i]:
                    await queue.put((i, out))
            except Exception as exc:  # noqa: BLE001 (handed to the consumer)
                await queue.put((i, exc))
            await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in live]
        try:
            remaining = len(live)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.http.receive()
            if message["type"] == "http.disconnect":
                break
        await self.abort_unfinished()

    async def abort_unfinished(self) -> None:
        for s in self.subs:
            if s.request_id not in self.finished:
                await self.engine.abort(s.request_id)

    async def close(self) -> None:
        """Abort what has not finished (a client gone, an error) and stop watching the client."""
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
        await self.abort_unfinished()
        for g in self._gens:
            aclose = getattr(g, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001, S110 (a generator already ended with its error)
                    pass


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def token_text(tokenizer: Any, token_id: int) -> str:
    """How a token is named in logprobs: its text, or `token_id:<id>` without a tokenizer (vLLM's form)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])
