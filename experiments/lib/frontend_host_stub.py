"""The stand-ins the front end's CPU probe (experiments/lib/frontend_cpu.py) runs the server's
code over, so that it times the front end's own work alone: a host whose engine answers at once
(`InstantHost`), the ASGI scope uvicorn would hand the app (`scope_for`), and a core's client with no
process behind it (`StubCoreClient`). The probe is copied outside any package and run against
another commit's tree (experiments.bench_frontend `--front-cpu --baseline REF`), this file beside it,
so it imports only the engine's public API.
"""
from __future__ import annotations

from engine.offline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.online.engine_stats import EngineStats, RequestStats
from engine.online.host import EngineHost, ModelInfo, StepResult

MODEL = "front-cpu"


class InstantHost(EngineHost):
    """A host whose 'engine' gives one token per loop turn to each request, from the turn after it
    is handed over (no process, no model)."""

    info = ModelInfo(MODEL, 1 << 16, 32000, None, 20)

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def bind(self, loop, sink) -> None:
        self.loop, self.sink = loop, sink

    @property
    def is_running(self) -> bool:
        return True

    def add(self, request) -> None:
        self.loop.call_soon(self._emit, request, 0)

    def _emit(self, request, i: int) -> None:
        last = i == self.tokens - 1
        sample = CompletionOutput(0, "", [7], "length" if last else None, None, None)
        output = RequestOutput(request.request_id, None, request.prompt, [sample], last,
                               RequestMetrics(0.0, 0.0, 0.0, 0.0 if last else None, 0), 0, None)
        record = RequestStats(request.request_id, "length", len(request.prompt), self.tokens, 1e-3,
                              [1e-3] * (self.tokens - 1), 1e-3 * self.tokens) if last else None
        self.sink(StepResult({}, [(output, record)]))
        if not last:
            self.loop.call_soon(self._emit, request, i + 1)

    def abort(self, request_id: str) -> None:
        pass

    def num_waiting(self) -> int:
        return 0

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0)

    def health_problem(self) -> None:
        return None

    async def shutdown(self) -> None:
        pass


def scope_for(body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}


class StubCoreClient:
    """What `ProcessHost` reads of a core's client, with no process behind it: the step messages come
    through the tree's own pipe reader (`LoopChannel`) from a pipe the caller writes (`core_fd`);
    what the host sends the core is dropped."""

    def __init__(self) -> None:
        import os
        from types import SimpleNamespace

        from engine.online.core_channel import LoopChannel
        from engine.online.output_wire import OutputReader

        class Channel(LoopChannel):
            def send(self, message) -> None:
                pass

        self.info = SimpleNamespace(model_name=MODEL, max_model_len=1 << 16, vocab_size=151936, max_logprobs=20)
        self.tokenizer = None
        recv_fd, self.core_fd = os.pipe()
        self.channel = Channel(os.open(os.devnull, os.O_WRONLY), recv_fd)
        self.alive = True
        self._reader = OutputReader()

    def outputs(self, step):  # a tree whose client, not its host, rebuilds the outputs
        return self._reader.read(step.outputs, step.finished)
