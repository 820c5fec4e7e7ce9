"""A replica that is alive but hung (SIGSTOPped) behind the server with two CPU replicas: with
requests outstanding and no step result for the replica timeout it leaves the rotation, its stream
ends with an error naming it and the timeout within a bound, its process is terminated, /health and
/metrics say so, and the other replica keeps serving; a stopped replica holding no request is not
hung. The engine core sends a message at least every `HEARTBEAT_S` while it steps, so a replica
whose steps produce no output (`final_only` requests) is heard from; `--replica-timeout-s` is
checked in one line."""
from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time

import pytest

httpx = pytest.importorskip("httpx2")

from test_fleet_server import metric
from test_serving_http import MODEL

from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.online.core_channel import read_message, write_message
from engine.online.engine_core import HEARTBEAT_S, CoreStep, serve
from engine.online.host import NewRequest
from engine.online.replica_launcher import launch_replica_set
from engine.serving.app import build_app
from engine.serving.server import ServerThread
from policies.request import SamplingParams
from policies.routing import make_router

TIMEOUT_S = 3.0  # the replica timeout of these tests
BOUND_S = 20.0  # every wait below ends by then


def args(model_dir: str) -> EngineArgs:
    return EngineArgs(model=model_dir, num_gpu_blocks=256, swap_space=0.01, max_model_len=512)


def fleet(model_dir: str) -> AsyncLLMEngine:
    return AsyncLLMEngine(launch_replica_set(args(model_dir), 2, make_router({"name": "round_robin"}),
                                             timeout_s=TIMEOUT_S))


def health(url: str) -> list[tuple[int, bool, str | None]]:
    resp = httpx.get(url + "/health", timeout=BOUND_S)
    assert resp.status_code == 200
    return [(r["replica"], r["alive"], r["error"]) for r in resp.json()["replicas"]]


def test_a_hung_replica_fails_its_stream_and_is_terminated_and_the_other_serves(model_dir):
    engine = fleet(model_dir)
    replicas = engine._host.replicas
    hung = replicas[1].host.client.process
    body = {"model": MODEL, "stream": True, "ignore_eos": True}
    with ServerThread(build_app(engine, MODEL)) as srv:
        # Round robin: the short stream on replica 0, the long one on replica 1, which is stopped once
        # its first token is out (it has hundreds to go).
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "prompt": [1, 2, 3], "max_tokens": 20},
                          timeout=BOUND_S) as short, \
                httpx.stream("POST", srv.url + "/v1/completions", json={**body, "prompt": [4, 5], "max_tokens": 500},
                             timeout=BOUND_S) as long:
            lines = [short.iter_lines(), long.iter_lines()]
            assert next(ln for ln in lines[1] if ln).startswith("data: {")
            os.kill(hung.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            assert [len(r.requests) for r in replicas][1] == 1, "replica 1 ended its request before it was stopped"
            ended = [ln for ln in lines[1] if ln]
            waited = time.monotonic() - stopped
            survived = [ln for ln in lines[0] if ln]
        assert TIMEOUT_S - 1.0 < waited < BOUND_S, waited
        assert ended[-1] == "data: [DONE]"
        message = json.loads(ended[-2][6:])["error"]["message"]
        assert "replica 1 stopped" in message and "hung" in message and "replica timeout 3 s" in message, message
        assert survived[-1] == "data: [DONE]"
        assert json.loads(survived[-2][6:])["choices"][0]["finish_reason"] == "length"
        state = health(srv.url)
        assert [(r, alive) for r, alive, _ in state] == [(0, True), (1, False)] and "hung" in state[1][2]
        assert metric(httpx.get(srv.url + "/metrics", timeout=BOUND_S).text, "servelab:replica_up", replica="1") == 0
        end = time.monotonic() + BOUND_S
        while hung.is_alive():  # terminated, then killed (a stopped process ignores SIGTERM)
            assert time.monotonic() < end, "the hung replica's process was never terminated"
            time.sleep(0.05)
        for _ in range(3):  # every new request goes to the live replica
            resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [7], "max_tokens": 2},
                              timeout=BOUND_S)
            assert resp.status_code == 200
        assert engine._host.num_routed == [4, 1]


def test_a_stopped_replica_with_no_request_is_not_hung(model_dir):
    engine = fleet(model_dir)
    idle = engine._host.replicas[1].host.client.process
    with ServerThread(build_app(engine, MODEL)) as srv:
        os.kill(idle.pid, signal.SIGSTOP)
        try:
            time.sleep(TIMEOUT_S + 1.5)  # past the timeout and the watchdog's next look
            assert [(r, alive) for r, alive, _ in health(srv.url)] == [(0, True), (1, True)]
        finally:
            os.kill(idle.pid, signal.SIGCONT)
        for _ in range(2):  # one on each replica: the one stopped while idle serves again
            resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [7], "max_tokens": 2},
                              timeout=BOUND_S)
            assert resp.status_code == 200
        assert engine._host.num_routed == [1, 1]
        assert [alive for _, alive, _ in health(srv.url)] == [True, True]


def test_a_core_whose_steps_give_no_output_is_heard_from(model_dir):
    """`final_only` requests give no output before they end: the core still sends a message at
    least every HEARTBEAT_S while it steps (each step slowed to 0.1 s, 40 steps)."""
    engine = LLMEngine(args(model_dir))
    step = engine.step
    engine.step = lambda: (time.sleep(0.1), step())[1]
    inbox_r, inbox_w = os.pipe()
    outbox_r, outbox_w = os.pipe()
    core = threading.Thread(target=serve, args=(engine, False, inbox_r, outbox_w, None), daemon=True)
    core.start()
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0, output_kind="final_only")
    write_message(inbox_w, ([NewRequest("r", [1, 2, 3], params, 0, None, time.monotonic())], ()))
    times, last = [], None
    while last is None or not last.outputs:
        last = read_message(outbox_r, BOUND_S)
        assert isinstance(last, CoreStep)
        times.append(time.monotonic())
    write_message(inbox_w, None)
    core.join(BOUND_S)
    assert not core.is_alive()
    assert times[-1] - times[0] > 3 * HEARTBEAT_S  # long enough to need heartbeats
    assert max(b - a for a, b in itertools.pairwise(times)) < HEARTBEAT_S + 1.0, times
    for fd in (inbox_r, inbox_w, outbox_r, outbox_w):
        os.close(fd)


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "2", "--replica-timeout-s", "0"], "error: --replica-timeout-s=0.0 is invalid: must be "
                                                                 "a finite number of seconds > 0"),
    (["--data-parallel-size", "2", "--replica-timeout-s", "nan"], "error: --replica-timeout-s=nan is invalid"),
    (["--data-parallel-size", "2", "--replica-timeout-s", "inf"], "error: --replica-timeout-s=inf is invalid"),
    (["--replica-timeout-s", "30"], "error: --replica-timeout-s is invalid without replicas"),
])
def test_bad_replica_timeout_is_one_line(capsys, argv, message):
    from engine.serve import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", "tiny-qwen3", "--device", "cpu", "--num-gpu-blocks", "16", "--max-model-len", "256", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err


def test_replica_set_checks_its_timeout(model_dir):
    with pytest.raises(ValueError, match=r"^replica_timeout_s=-1 is invalid: must be a finite number of seconds > 0"):
        launch_replica_set(args(model_dir), 2, make_router({"name": "round_robin"}), timeout_s=-1)
