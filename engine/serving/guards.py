"""What every HTTP request passes before its route (a pure ASGI layer, no task per request):

- the API key: with `--api-key` (or the SERVELAB_API_KEY environment variable; vLLM's are
  `--api-key` and VLLM_API_KEY) every `/v1/*` request needs `Authorization: Bearer <key>`, else
  401; `/health` and `/metrics` stay open, as in vLLM. Off by default.
- the body size cap (`--max-request-body-bytes`): a body declared larger (Content-Length) is refused
  with 413 before it is read; a chunked body is read up to the cap, then refused. The default
  admits a prompt of max_model_len tokens written out in JSON (`default_max_body_bytes`).
"""
from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.serving.errors import APIError
from policies.request import is_int

API_KEY_ENV = "SERVELAB_API_KEY"
BYTES_PER_TOKEN = 64  # room for one prompt token in a JSON body: a long token, six-byte \u escapes
MIN_BODY_BYTES = 1 << 20


def default_max_body_bytes(max_model_len: int) -> int:
    """A body cap that admits a prompt of max_model_len tokens, text or token ids (at least 1 MiB)."""
    return max(MIN_BODY_BYTES, BYTES_PER_TOKEN * max_model_len)


def api_keys_from(option: Sequence[str] | None) -> tuple[str, ...]:
    """The keys `--api-key` names, else the SERVELAB_API_KEY environment variable's, else none."""
    keys = tuple(option or ()) or tuple(k for k in [os.environ.get(API_KEY_ENV, "")] if k)
    for key in keys:
        if not key or key != key.strip():
            raise ValueError("api_key is invalid: a key must be non-empty, without surrounding whitespace")
    return keys


def check_max_body_bytes(value: object) -> int:
    """`--max-request-body-bytes`: an integer >= 1, or ValueError naming it."""
    if not is_int(value) or value < 1:
        raise ValueError(f"max_request_body_bytes={value!r} is invalid: an integer >= 1")
    return value


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, api_keys: Sequence[str] = ()) -> None:
        check_max_body_bytes(max_body_bytes)
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._keys = [k.encode() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self._keys and _under_v1(scope["path"]) and not self._authorized(headers.get(b"authorization")):
            await _refuse(send, APIError(401, "missing or wrong API key: send the header "
                                         "'Authorization: Bearer <key>' with the server's --api-key"))
            return
        cap, length = self.max_body_bytes, headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > cap:
                await _refuse(send, _too_large(cap))
                return
        elif scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await _buffered(receive, cap)
            if receive is None:
                await _refuse(send, _too_large(cap))
                return
        await self.app(scope, receive, send)

    def _authorized(self, header: bytes | None) -> bool:
        if header is None or header[:7].lower() != b"bearer ":
            return False
        given = header[7:].strip()
        # Every key compared, in constant time each: the answer's timing does not tell which failed.
        return sum(secrets.compare_digest(given, key) for key in self._keys) > 0


def _under_v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _too_large(cap: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {cap} bytes "
                    "(--max-request-body-bytes)")


async def _buffered(receive: Receive, cap: int) -> Receive | None:
    """A body without Content-Length read up to `cap` bytes and replayed to the app; None past the
    cap (or when the client left)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body = message.get("body", b"")
        size += len(body)
        if size > cap:
            return None
        chunks.append(body)
        if not message.get("more_body", False):
            break
    pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()  # then disconnects, as before

    return replay


async def _refuse(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 413:
        headers.append((b"connection", b"close"))  # the unread body is not waited for
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
