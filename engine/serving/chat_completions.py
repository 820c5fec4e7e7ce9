"""`POST /v1/chat/completions`: messages -> the chat template -> one engine request -> OpenAI chat
completion, whole or streamed (`chat.completion.chunk`s; a choice's first delta carries the role)."""
from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest

from engine.serving.generation import (
    Generation,
    SubRequest,
    error_event,
    finish_reason,
    has_news,
    sampling_params,
    token_text,
)
from engine.serving.protocol import ChatCompletionRequest
from engine.serving.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    TokenLogprob,
    TopLogprob,
    random_id,
)
from engine.serving.sse import DONE, SSEResponse, event, frame


async def create_chat_completion(ctx: Any, req: ChatCompletionRequest, http: HTTPRequest):
    """ctx: the app's ServingContext."""
    ctx.check_model(req.model)
    ids = await ctx.encode_chat([m.for_template() for m in req.messages], req.add_generation_prompt)
    renames = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    params = sampling_params(req, len(ids), ctx.max_model_len, req.requested_max_tokens, req.num_logprobs,
                             "messages", renames, ctx.max_logprobs)
    base_id = random_id("chatcmpl")
    gen = Generation(ctx.engine, [SubRequest(base_id, ids, params)], http, req.priority, req.user or None)
    await gen.start()
    if req.stream:
        return SSEResponse(_stream(ctx, req, gen, base_id))
    return await _whole(ctx, req, gen, base_id)


def _logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]] | None,
              top: int) -> ChatLogprobs | None:
    if logprobs is None:
        return None
    content = []
    for token_id, lps in zip(token_ids, logprobs):
        best = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
        content.append(TokenLogprob(
            token=token_text(tokenizer, token_id), logprob=lps.get(token_id, float("-inf")),
            bytes=list(token_text(tokenizer, token_id).encode()),
            top_logprobs=[TopLogprob(token=token_text(tokenizer, t), logprob=lp,
                                     bytes=list(token_text(tokenizer, t).encode())) for t, lp in best]))
    return ChatLogprobs(content=content)


async def _whole(ctx: Any, req: ChatCompletionRequest, gen: Generation, base_id: str) -> JSONResponse:
    outputs = await gen.collect(req.n)
    choices = [ChatChoice(
        index=index, message=AssistantMessage(content=whole.text),
        logprobs=_logprobs(ctx.tokenizer, whole.token_ids, whole.logprobs if req.logprobs else None,
                           req.top_logprobs or 0),
        finish_reason=whole.finish_reason, stop_reason=whole.stop_reason,
        token_ids=whole.token_ids if req.return_token_ids else None)
        for index, whole in outputs.items()]
    body = ChatCompletionResponse(
        id=base_id, model=req.model, choices=choices,
        usage=gen.token_usage(),
        prompt_token_ids=gen.subs[0].prompt_token_ids if req.return_token_ids else None)
    return JSONResponse(body.model_dump(exclude_none=True))


async def _stream(ctx: Any, req: ChatCompletionRequest, gen: Generation, base_id: str):
    created = ctx.created()
    head = ('{"id":' + json.dumps(base_id) + ',"object":"chat.completion.chunk","created":' + str(created)
            + ',"model":' + json.dumps(req.model) + ',"choices":')
    started: set[int] = set()
    try:
        async for _, out in gen.outputs():
            choices = []
            for c in out.outputs:
                if not has_news(c):
                    continue
                delta: dict[str, Any] = {"content": c.text}
                if c.index not in started:
                    started.add(c.index)
                    delta = {"role": "assistant", **delta}
                choice: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": None,
                                          "finish_reason": finish_reason(c.finish_reason)}
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                if req.logprobs and c.logprobs is not None:
                    choice["logprobs"] = _logprobs(ctx.tokenizer, c.token_ids, c.logprobs,
                                                   req.top_logprobs or 0).model_dump()
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
            if choices:
                yield frame(head + json.dumps(choices) + "}")
    except Exception as exc:  # noqa: BLE001 (the status line is sent: the error goes into the stream)
        yield error_event(exc)
    else:
        if req.include_usage:
            chunk = ChatCompletionChunk(id=base_id, created=created, model=req.model, choices=[],
                                        usage=gen.token_usage())
            yield event(chunk.model_dump())
    yield DONE
