"""The app class whose generation routes are dispatched ahead of starlette's routing.

`ServingApp` is a FastAPI app; `route_ahead(path, endpoint)` adds a POST route as `add_route` does,
and also builds for it a short ASGI stack that `__call__` sends a POST to exactly that path
straight into, past FastAPI's per-request entry, its body-limit and exception-telemetry layers, the
AsyncExitStack layer (it closes uploaded files; these routes take none) and the router's walk of
every route. The short stack is starlette's own pieces in the same order as the full app's, so
every response, error and log line is the same: ServerErrorMiddleware with the app's handler for
Exception (a 500, the exception re-raised for uvicorn to log), every user middleware (the request
guard: API key, body size), ExceptionMiddleware with the app's other handlers, and the endpoint
under starlette's `request_response`. A request whose scope carries a root_path, or any other
method or path, takes the full app. FastAPI's OpenTelemetry spans (on only when a tracer provider
is configured, which servelab never does) are not opened for the routes ahead.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import request_response
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


class ServingApp(FastAPI):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._endpoints_ahead: dict[str, Endpoint] = {}
        self._stacks_ahead: dict[str, ASGIApp] | None = None  # built at the first request, as middleware_stack

    def route_ahead(self, path: str, endpoint: Endpoint) -> None:
        """A POST route at `path`, in the router too (anything that lists app.routes sees it)."""
        self.add_route(path, endpoint, methods=["POST"])
        self._endpoints_ahead[path] = endpoint
        self._stacks_ahead = None

    def _build_stacks_ahead(self) -> dict[str, ASGIApp]:
        error_handler = None
        handlers = {}
        for key, value in self.exception_handlers.items():  # split as build_middleware_stack does
            if key in (500, Exception):
                error_handler = value
            else:
                handlers[key] = value
        stacks = {}
        for path, endpoint in self._endpoints_ahead.items():
            app: ASGIApp = ExceptionMiddleware(request_response(endpoint), handlers=handlers, debug=self.debug)
            for cls, args, kwargs in reversed(self.user_middleware):
                app = cls(app, *args, **kwargs)
            stacks[path] = ServerErrorMiddleware(app, handler=error_handler, debug=self.debug)
        return stacks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            stacks = self._stacks_ahead
            if stacks is None:
                stacks = self._stacks_ahead = self._build_stacks_ahead()
            stack = stacks.get(scope["path"])
            if stack is not None:
                scope["app"] = self
                await stack(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def through_router(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The full app for every request, the routes ahead included (tests compare the two)."""
        await super().__call__(scope, receive, send)
