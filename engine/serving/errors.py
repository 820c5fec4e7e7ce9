"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every error a route can meet becomes one `APIError` (status, message, the offending field):
pydantic's validation errors and servelab's ValueErrors (`"<field>=<value> is invalid: ..."`, the
convention of SamplingParams and Request.validate) give 400 naming the field; an unknown model 404;
a full queue 503; a dead engine 503; a missing or wrong API key 401; a body over the size cap 413.
Bodies carry short messages only: tracebacks and exception details go to the server's log.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from engine.serving.responses import ErrorBody, ErrorResponse

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

_FIELD_AT_START = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*)=")
_FIELD_IN_MESSAGE = re.compile(r"^([a-z_]+)(?:=|\s)")
# The request field an engine-side name stands for (Request.validate names the token ids).
_ENGINE_FIELDS = {"prompt_token_ids": "prompt"}
Body = TypeVar("Body", bound=BaseModel)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        err = ErrorBody(message=self.message, type=ERROR_TYPES.get(self.status, "APIError"),
                        param=self.param, code=self.status)
        return ErrorResponse(error=err).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_value(exc: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """A servelab ValueError -> 400 whose `param` is the field its message starts with (renamed to
    the request's name for it where they differ, e.g. max_tokens for max_completion_tokens, or
    prompt[1] for the second of several prompts, whose `param` is then `prompt`)."""
    message = str(exc)
    match = _FIELD_AT_START.match(message)
    param = match.group(1) if match else None
    names = {**_ENGINE_FIELDS, **(rename or {})}
    if param in names:
        message = names[param] + message[len(param):]
        param = field_param(names[param])
    return APIError(400, message, param)


def field_param(name: str) -> str:
    """The request field a message's name lies in: `prompt[2]` -> `prompt`."""
    return name.partition("[")[0]


def validation_error(errors: Sequence[dict[str, Any]], specific: dict[str, str] | None = None) -> APIError:
    """pydantic's errors of a request body -> one 400 naming the first field (all listed).
    `specific`: field -> one message standing for all of that field's errors."""
    parts, first = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if specific and loc and loc[0] in specific:
            parts.append(specific[loc[0]])
            first = first or loc[0]
            continue
        # Union members add their type name to the location (prompt.str, prompt.list[int]): drop them.
        field = ".".join(x for x in loc if not _is_type_tag(x)) or None
        msg = err.get("msg", "invalid")
        msg = msg.removeprefix("Value error, ")
        if field is None:  # a check across fields: its message starts with the field it blames
            match = _FIELD_IN_MESSAGE.match(msg)
            field = match.group(1) if match else None
            if field is not None:
                parts.append(msg)
                first = first or field
                continue
        first = first or field
        if err.get("type") == "extra_forbidden":
            msg = "unknown field (not an OpenAI or vLLM parameter this server accepts)"
        parts.append(f"{field}: {msg}" if field else msg)
    return APIError(400, "; ".join(dict.fromkeys(parts)) or "invalid request body", first)


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict[", "function-"))


def parse_request(body: bytes, model: type[Body]) -> Body:
    """A request body as `model`, or the 400 naming the first bad field. Parsed and validated in one
    pass by pydantic's JSON validator (a token-id prompt is hundreds of numbers: json.loads and
    then validating the dict cost twice as much, on every request's way to its first token). A
    body that validator refuses as JSON goes through Python's parser, which also reads what the
    fast one does not (a lone surrogate's \\ud800 escape, which the model then names). A model's
    `field_problems(data)` (if it has one) words the errors of a field it explains better."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        if not any(e["type"] == "json_invalid" for e in errors):
            raise _refused(model, body, errors) from None
    try:
        data = json.loads(body)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _refused(model, data, exc.errors()) from None


def _refused(model: type[BaseModel], body: bytes | Any, errors: Sequence[dict[str, Any]]) -> APIError:
    """The 400 for a body pydantic refused (the body parsed again only here, off the hot path)."""
    explain = getattr(model, "field_problems", None)
    if explain is None:
        return validation_error(errors)
    if isinstance(body, bytes):
        try:
            body = json.loads(body)
        except ValueError:
            body = None
    return validation_error(errors, explain(body) if isinstance(body, dict) else None)
