"""`POST /v1/completions`: prompts (text, token ids, or a list of either) -> OpenAI completion,
whole or streamed as server-sent events (one chunk per engine output, i.e. per step and request at
most; `data: [DONE]` last; with `stream_options.include_usage` a usage chunk before it)."""
from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest

from engine.offline.outputs import CompletionOutput
from engine.serving.errors import APIError
from engine.serving.generation import (
    Generation,
    SubRequest,
    error_event,
    finish_reason,
    has_news,
    sampling_params,
    token_text,
)
from engine.serving.protocol import CompletionRequest
from engine.serving.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, random_id
from engine.serving.sse import DONE, SSEResponse, event

_json_str = json.encoder.encode_basestring_ascii  # a str as a JSON string literal (C, as json.dumps)


async def create_completion(ctx: Any, req: CompletionRequest, http: HTTPRequest):
    """ctx: the app's ServingContext."""
    ctx.check_model(req.model)
    try:
        prompts = req.prompts()
    except ValueError as exc:
        raise APIError(400, str(exc), "prompt") from None
    base_id = random_id("cmpl")
    subs = []
    for i, prompt in enumerate(prompts):
        name = req.prompt_field(i)  # prompt[i] in a list of prompts: the message says which
        ids = await ctx.encode(prompt, name)
        params = sampling_params(req, len(ids), ctx.max_model_len, req.max_tokens, req.logprobs, name, {},
                                 ctx.max_logprobs)
        subs.append(SubRequest(f"{base_id}-{i}" if len(prompts) > 1 else base_id, ids, params))
    gen = Generation(ctx.engine, subs, http, req.priority, req.user or None)
    await gen.start()
    if req.stream:
        return SSEResponse(_stream(ctx, req, gen, base_id))
    return await _whole(ctx, req, gen, base_id)


def _logprobs(tokenizer: Any, c: CompletionOutput, offset: int) -> CompletionLogprobs | None:
    if c.logprobs is None:
        return None
    out = CompletionLogprobs()
    for token_id, lps in zip(c.token_ids, c.logprobs):
        text = token_text(tokenizer, token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lps.get(token_id))
        out.top_logprobs.append({token_text(tokenizer, t): lp for t, lp in lps.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


async def _whole(ctx: Any, req: CompletionRequest, gen: Generation, base_id: str) -> JSONResponse:
    n = req.n
    outputs = await gen.collect(n)
    choices = [CompletionChoice(
        index=index, text=whole.text, logprobs=_logprobs(ctx.tokenizer, whole, 0),
        finish_reason=whole.finish_reason, stop_reason=whole.stop_reason,
        token_ids=whole.token_ids if req.return_token_ids else None,
        prompt_token_ids=gen.subs[index // n].prompt_token_ids if req.return_token_ids else None)
        for index, whole in outputs.items()]
    body = CompletionResponse(id=base_id, model=req.model, choices=choices, usage=gen.token_usage())
    return JSONResponse(body.model_dump(exclude_none=True))


async def _stream(ctx: Any, req: CompletionRequest, gen: Generation, base_id: str):
    n, created = req.n, ctx.created()
    # Every chunk shares its head: only the choices are serialized per chunk (the hot path: one
    # chunk per running request per step). A plain text delta is formatted directly.
    head = ('data: {"id":' + json.dumps(base_id) + ',"object":"text_completion","created":' + str(created)
            + ',"model":' + json.dumps(req.model) + ',"choices":[')
    plain = req.logprobs is None and not req.return_token_ids and not _continuous_usage(req)
    offsets: dict[int, int] = {}
    try:
        async for i, out in gen.outputs():
            parts = []
            for c in out.outputs:
                if not has_news(c):
                    continue
                index = i * n + c.index
                if plain and c.finish_reason is None:
                    parts.append(f'{{"index":{index},"text":{_json_str(c.text)},"logprobs":null,'
                                 '"finish_reason":null}')
                    continue
                choice: dict[str, Any] = {"index": index, "text": c.text, "logprobs": None,
                                          "finish_reason": finish_reason(c.finish_reason)}
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                if c.logprobs is not None:
                    lp = _logprobs(ctx.tokenizer, c, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + len(c.text)
                    choice["logprobs"] = lp.model_dump()
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                parts.append(json.dumps(choice))
            if parts:
                yield head + ",".join(parts) + "]" + _usage_tail(req, gen) + "}\n\n"
    except Exception as exc:  # noqa: BLE001 (the status line is sent: the error goes into the stream)
        yield error_event(exc)
    else:
        if req.include_usage:
            yield event(CompletionResponse(id=base_id, created=created, model=req.model, choices=[],
                                           usage=gen.token_usage()).model_dump())
    yield DONE


def _continuous_usage(req: CompletionRequest) -> bool:
    return req.stream_options is not None and req.stream_options.continuous_usage_stats


def _usage_tail(req: CompletionRequest, gen: Generation) -> str:
    if not _continuous_usage(req):
        return ""
    return ',"usage":' + gen.token_usage().model_dump_json()
