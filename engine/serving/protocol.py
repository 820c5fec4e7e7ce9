"""OpenAI's request bodies (pydantic), with vLLM's extensions (the responses: engine/serving/responses.py).

Requests reject unknown fields (a misspelt parameter is a 400 naming it, never silently ignored)
and OpenAI parameters the engine does not implement (`echo`, `suffix`, `best_of` != n, a
non-empty `logit_bias`, `response_format` other than text, `tools`, `tool_choice` other than
"none", `parallel_tool_calls`, vLLM's `chat_template_kwargs`: "not supported by this server");
`store` and `metadata` are accepted and ignored (nothing is stored). Text must be valid Unicode: a
lone surrogate (JSON's "\\ud800", which no tokenizer can encode) is a 400 naming the field. Value
checks (ranges, combinations) are `SamplingParams`' own: the routes build one from
`sampling_kwargs()` and turn its ValueError into a 400 naming the field.
vLLM's extensions: `top_k`, `min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`repetition_penalty`, `include_stop_str_in_output`, `skip_special_tokens`, `priority`,
`return_token_ids`; chat also `add_generation_prompt`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from policies.request import is_int


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def unicode_problem(text: str) -> str | None:
    """Why `text` is not valid Unicode (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"holds a lone surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}): "
                "text must be valid Unicode")
    return None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


def unsupported(field: str, value: Any, allowed: str = "") -> ValueError:
    return ValueError(f"{field}={value!r:.80} is not supported by this server{allowed}")


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingFields(StrictModel):
    """Fields both endpoints map onto SamplingParams (None: SamplingParams' default)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    priority: int = 0  # vLLM's extension: lower = more urgent (the priority policy)
    user: str | None = None  # the client's end-user id (kept on the request for per-tenant policies)
    return_token_ids: bool = False  # vLLM's extension: prompt and output token ids in the response
    response_format: ResponseFormat | None = None  # only {"type": "text"} (no structured output)

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingFields:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server (leave it out or empty)")
        if self.response_format is not None and self.response_format.type != "text":
            raise unsupported("response_format", self.response_format.model_dump(), ' (only {"type": "text"})')
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def sampling_kwargs(self, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
        """Keyword arguments for SamplingParams: only what the request sets."""
        out: dict[str, Any] = {"n": self.n, "max_tokens": max_tokens, "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens",
                     "include_stop_str_in_output", "skip_special_tokens", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if logprobs is not None:
            out["logprobs"] = logprobs
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# Left to right: a token-id prompt validates as list[int] in one pass. Pydantic's default (smart)
# mode validates it against every member to pick the best match, 7x the time for a 1,000-token
# prompt (65 us against 9 us), paid on every request before it reaches the engine.
# Strict ints first, so ["1", "2"] stays two text prompts rather than coercing to token ids; strict in
# a list of token-id prompts too ([[1, "2"]], [[true]] and [[2.0]] are refused as [1, "2"] is).
Prompt = Annotated[str | list[StrictInt] | list[str] | list[list[StrictInt]], Field(union_mode="left_to_right")]
PROMPT_SHAPES = "a string, a list of token ids, a list of strings or a list of token-id lists"


def prompt_problem(p: object) -> str | None:
    """Why `p` (a request's raw `prompt`) fits none of the prompt shapes, naming its first bad
    element (`prompt[1]=2.5`), or None if it fits one. The shape is the first element's: a number
    starts token ids, a string a list of texts, a list a list of token-id lists. Read only for a
    body pydantic refused: its errors list every member of the union instead."""
    if isinstance(p, str) or p == []:
        return None
    if not isinstance(p, list):
        return f"prompt={p!r:.60} is invalid: must be {PROMPT_SHAPES}"
    if isinstance(p[0], str):
        bad = next((i for i, x in enumerate(p) if not isinstance(x, str)), None)
        return None if bad is None else (f"prompt[{bad}]={p[bad]!r:.60} is invalid: a list of text prompts holds "
                                         "strings only")
    if isinstance(p[0], list):
        for i, ids in enumerate(p):
            if not isinstance(ids, list):
                return f"prompt[{i}]={ids!r:.60} is invalid: a list of token-id prompts holds lists of token ids only"
            bad = next((j for j, t in enumerate(ids) if not is_int(t)), None)
            if bad is not None:
                return f"prompt[{i}][{bad}]={ids[bad]!r:.60} is invalid: token ids must be integers"
        return None
    if not isinstance(p[0], (int, float)):  # neither a number nor a string nor a list
        return f"prompt[0]={p[0]!r:.60} is invalid: a list prompt holds token ids, strings or token-id lists"
    bad = next((i for i, t in enumerate(p) if not is_int(t)), None)
    return None if bad is None else f"prompt[{bad}]={p[bad]!r:.60} is invalid: token ids must be integers"


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top logprobs per token (0 = the sampled token's only)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported_completion(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, str):
            if problem := unicode_problem(p):
                raise ValueError(f"prompt {problem}")
        elif p and isinstance(p[0], str):  # a list of texts (a token-id list is not walked: hot path)
            for i, text in enumerate(p):
                if problem := unicode_problem(text):
                    raise ValueError(f"prompt {problem} (prompt {i} of the list)")
        if self.echo:
            raise ValueError("echo=true is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported: only best_of == n")
        return self

    @classmethod
    def field_problems(cls, data: dict[str, Any]) -> dict[str, str]:
        """For a body pydantic refused: one message per field whose raw value this model can explain
        better than pydantic's list of union members (the prompt), by field."""
        problem = prompt_problem(data["prompt"]) if "prompt" in data else None
        return {"prompt": problem} if problem else {}

    def prompt_field(self, index: int) -> str:
        """How a message names prompt `index`: `prompt` when the request has one, `prompt[i]` in a list."""
        p = self.prompt
        return "prompt" if isinstance(p, str) or (p and isinstance(p[0], int)) else f"prompt[{index}]"

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids (OpenAI's four prompt shapes)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt=[] is invalid: give a string, a list of token ids, or a list of those")
        if isinstance(p[0], int):  # the union's members are homogeneous: one look tells which it is
            return [list(p)]
        return [x if isinstance(x, str) else list(x) for x in p]


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... travel to the template

    role: str
    content: str | list[TextPart] | None = None

    @model_validator(mode="after")
    def _valid_text(self) -> ChatMessage:
        parts = self.content if isinstance(self.content, list) else [self.content]
        texts = {"role": self.role, **(self.model_extra or {})}
        texts.update((f"content[{i}]" if len(parts) > 1 else "content", p.text if isinstance(p, TextPart) else p)
                     for i, p in enumerate(parts))
        for name, text in texts.items():  # every string reaches the template, then the tokenizer
            if isinstance(text, str) and (problem := unicode_problem(text)):
                raise ValueError(f"{name} {problem}")
        return self

    def for_template(self) -> dict[str, Any]:
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = "".join(part.text for part in self.content)
        return msg


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, str] | None = None  # accepted with store; ignored
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _logprob_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tools:
            raise unsupported("tools", self.tools, " (no tool calling)")
        if self.tool_choice not in (None, "none"):
            raise unsupported("tool_choice", self.tool_choice, ' (only "none")')
        if self.parallel_tool_calls is not None:
            raise unsupported("parallel_tool_calls", self.parallel_tool_calls, " (no tool calling)")
        if self.chat_template_kwargs:
            raise unsupported("chat_template_kwargs", self.chat_template_kwargs)
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
