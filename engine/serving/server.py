"""Run the app under uvicorn: in the foreground (`python -m engine.serve`) or in a background thread
(tests and benchmarks that keep the engine in their own process).

`ServerThread(app, port=0)` binds 127.0.0.1 at a free port, starts uvicorn's loop in a daemon
thread, and returns once the socket accepts connections; `.url` is the base URL (`.../v1` is the
OpenAI base URL); `stop()` (or leaving the `with` block) shuts it down.

`Server` is uvicorn's server that, when it starts to shut down (SIGTERM, Ctrl-C, `stop()`), first
calls the app's `state.end_streams()`: every open stream ends with an error event and
`data: [DONE]`, its connection closes, and the shutdown completes in a moment instead of waiting
for uvicorn's graceful timeout and cancelling the responses.
"""
from __future__ import annotations

import importlib.util
import socket
import threading
import time

import uvicorn

LOOPBACK = "127.0.0.1"


def uvicorn_config(app, host: str = LOOPBACK, port: int = 8000, log_level: str = "warning") -> uvicorn.Config:
    # One event loop, no reload, no access log per request (a log line per request costs as much
    # as a decode step's host work at high request rates); uvloop and httptools where installed.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=5, loop="auto", http="auto")


class Server(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        end_streams = getattr(getattr(self.config.app, "state", None), "end_streams", None)
        if end_streams is not None:
            end_streams()
        await super().shutdown(sockets)


def slow_io_warning() -> str | None:
    """What uvicorn falls back to when uvloop or httptools is missing, or None."""
    missing = [name for name in ("uvloop", "httptools") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"{' and '.join(missing)} not installed: uvicorn serves on plain asyncio / h11, which costs the "
            "front end 15-20% more CPU per streamed chunk (pip install uvloop httptools)")


class ServerThread:
    def __init__(self, app, host: str = LOOPBACK, port: int = 0, log_level: str = "warning",
                 start_timeout_s: float = 30.0) -> None:
        self.server = Server(uvicorn_config(app, host, port, log_level))  # no signal handlers off the main thread
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if self._error is not None or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {start_timeout_s} s")
            time.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.host, self.port = sock.getsockname()[:2]

    def _run(self) -> None:
        try:
            self.server.run()  # uvicorn's event loop (uvloop when installed)
        except BaseException as exc:  # noqa: BLE001 (reported to the starting thread)
            self._error = exc

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> ServerThread:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
