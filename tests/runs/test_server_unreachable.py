"""backend=server (experiments.run, experiments.bench_serving) pointed where no OpenAI-compatible
server answers: one line naming the URL and what to do, exit code 2, with at most the HTTP status
and a short excerpt of what answered (a closed port; a plain http.server in a thread)."""
from __future__ import annotations

import json
import re
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_bad_input_run import cli_error

from experiments import bench_serving

SMALL = ["backend=server", "workload=poisson", "workload.num_requests=3", "backend.timeout_s=20"]
PAGE = "<!DOCTYPE html><html><head><title>Not here</title></head><body>" + "<p>nothing to see</p>" * 200 + "</body></html>"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Page(BaseHTTPRequestHandler):
    """A web server that is no OpenAI one: an HTML 404 page for every GET, 501 for POST (no do_POST);
    `models` set: GET /v1/models lists that model; `post_404` set: every POST is a 404 with that
    JSON body (an OpenAI server refusing the request's `model`)."""
    models: bytes | None = None
    post_404: bytes | None = None

    def do_GET(self) -> None:
        status, body, kind = 404, PAGE.encode(), "text/html"
        if self.models is not None and self.path == "/v1/models":
            status, body, kind = 200, self.models, "application/json"
        self.answer(status, body, kind)

    def do_POST(self) -> None:
        if self.post_404 is None:
            self.send_error(501, "Unsupported method ('POST')")
            return
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.answer(404, self.post_404, "application/json")

    def answer(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def web_server(models: bytes | None = None, post_404: bytes | None = None) -> Iterator[str]:
    handler = type("Handler", (_Page,), {"models": models, "post_404": post_404})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.timeout = 5
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_nothing_listening(monkeypatch, capsys, tmp_path):
    port = closed_port()
    err = cli_error([*SMALL, f"backend.url=http://127.0.0.1:{port}", f"hydra.run.dir={tmp_path}"], monkeypatch, capsys)
    assert err.startswith(f"error: backend.url='http://127.0.0.1:{port}' is invalid: no server answers there (")
    assert f"python -m engine.serve --model MODEL --port {port}" in err and "backend.url" in err


def test_nothing_listening_with_the_model_given(monkeypatch, capsys, tmp_path):
    """No GET /v1/models first: every request fails to connect, and that is the error too."""
    port = closed_port()
    err = cli_error([*SMALL, f"backend.url=http://127.0.0.1:{port}", "backend.model=m", f"hydra.run.dir={tmp_path}"],
                    monkeypatch, capsys)
    assert err.startswith(f"error: backend.url='http://127.0.0.1:{port}' is invalid: no server answers there (")


def test_bench_serving_with_nothing_listening(monkeypatch, capsys, tmp_path):
    port = closed_port()
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["bench_serving", "model=tiny-llama", *SMALL[1:], f"backend.url=http://127.0.0.1:{port}",
                                      "progress=false", "plots=false", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        bench_serving.main()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and err.startswith(f"error: backend.url='http://127.0.0.1:{port}' is invalid: no server"), err


@pytest.mark.parametrize("models, answer", [
    (None, r"GET http://127.0.0.1:\d+/v1/models answered HTTP 404 \('Not here nothing to see nothing to see"),
    (b'{"object": "list"}', r"answered no OpenAI model list \('\{\"object\": \"list\"\}'\)"),
    (b'{"object": "list", "data": []}', r"answered no model"),
])
def test_a_server_without_the_models_endpoint(models, answer, monkeypatch, capsys, tmp_path):
    with web_server(models) as url:
        err = cli_error([*SMALL, f"backend.url={url}", f"hydra.run.dir={tmp_path}"], monkeypatch, capsys)
    assert err.startswith(f"error: backend.url='{url}' is invalid: ") and re.search(answer, err), err
    assert "<" not in err and len(err) < 400, err  # an excerpt, not the page


@pytest.mark.parametrize("models", [b'{"data": [{"id": "m"}]}', None])
def test_a_server_without_the_completions_endpoint(models, monkeypatch, capsys, tmp_path):
    with web_server(models) as url:
        given = [] if models else ["backend.model=m"]
        err = cli_error([*SMALL, f"backend.url={url}", *given, f"hydra.run.dir={tmp_path}"], monkeypatch, capsys)
    assert err.startswith(f"error: backend.url='{url}' is invalid: POST {url}/v1/completions answered HTTP 501 ("), err
    assert "<" not in err and len(err) < 400, err


UNKNOWN_MODEL = "The model `m` does not exist."
OPENAI_404S = {  # an unknown `model`, in OpenAI's error shape and in vLLM's older one
    "openai": json.dumps({"error": {"message": UNKNOWN_MODEL, "type": "NotFoundError", "param": "model",
                                    "code": 404}}).encode(),
    "vllm-object-error": json.dumps({"object": "error", "message": UNKNOWN_MODEL, "type": "NotFoundError",
                                     "param": None, "code": 404}).encode(),
}


@pytest.mark.parametrize("body", OPENAI_404S.values(), ids=OPENAI_404S.keys())
@pytest.mark.parametrize("models", [None, b'{"data": [{"id": "m"}]}'], ids=["model-given", "model-listed"])
def test_a_404_in_openai_error_shape_is_the_model_not_the_endpoint(body, models, monkeypatch, capsys, tmp_path):
    """The completions endpoint is there and refuses the model: its message and backend.model, not
    'no such endpoint, start a server'."""
    with web_server(models, post_404=body) as url:
        given = [] if models else ["backend.model=m"]
        err = cli_error([*SMALL, f"backend.url={url}", *given, f"hydra.run.dir={tmp_path}"], monkeypatch, capsys)
    assert err.startswith("error: backend.model='m'"), err
    assert f"is invalid: POST {url}/v1/completions answered HTTP 404 ('{UNKNOWN_MODEL}'): check backend.model" in err
    assert "engine.serve" not in err and len(err) < 400, err


def test_a_404_that_is_no_openai_error_is_still_no_endpoint(monkeypatch, capsys, tmp_path):
    with web_server(post_404=b'{"detail": "Not Found"}') as url:
        err = cli_error([*SMALL, f"backend.url={url}", "backend.model=m", f"hydra.run.dir={tmp_path}"],
                        monkeypatch, capsys)
    assert err.startswith(f"error: backend.url='{url}' is invalid: POST {url}/v1/completions answered HTTP 404 ("), err
    assert "python -m engine.serve" in err, err
