"""The front's pipe to the decode process never blocks the front: `PipeSender` (engine/disagg/pipe_sender.py)
keeps the order of the messages, returns at once while the reader does not read, reports how many
wait and for how long, and ends its thread when the reader goes; a pair whose decode process is
stopped mid-run keeps stepping its prefill engine, fails the decode engine as hung within
transfer_timeout_s naming the messages left waiting, ends every request and closes within its bound.
Every wait here is bounded (a blocked front is detected, not waited for)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time

import pytest
from disagg_helpers import SignalAtFirstHandOff
from engine_helpers import ragged_prompts
from test_disagg_engine import ARGS, GREEDY, _run

from engine.disagg.config import DisaggregationConfig
from engine.disagg.pd_engine import JOIN_TIMEOUT_S, DisaggregatedEngine
from engine.disagg.pipe_sender import PipeSender
from engine.engine_args import EngineArgs

WAIT_S = 5.0  # any single wait of these tests
MESSAGE = b"x" * 4096


def _shrink_send_buffer(conn) -> None:
    """The socket under `conn` holds a few KB unread (the kernel's minimum), so a reader that does
    not read fills it after a few messages."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    finally:
        sock.close()


def _bounded(fn, timeout_s: float = WAIT_S) -> None:
    """Run `fn` on a thread; fail if it has not returned within `timeout_s` (it blocked)."""
    caller = threading.Thread(target=fn, daemon=True)
    caller.start()
    caller.join(timeout_s)
    assert not caller.is_alive(), f"{fn} blocked for {timeout_s} s"


@pytest.fixture
def pipe():
    ours, theirs = multiprocessing.Pipe()
    _shrink_send_buffer(ours)
    sender = PipeSender(ours, "test-pipe-sender")
    yield sender, theirs
    theirs.close()  # a write still blocked fails now: the thread ends
    assert sender.close(WAIT_S)
    ours.close()


def test_a_reader_that_does_not_read_never_blocks_the_caller_and_order_is_kept(pipe):
    sender, reader = pipe
    count = 64  # 256 KB: far more than the socket holds
    _bounded(lambda: [sender.send((i, MESSAGE)) for i in range(count)])
    time.sleep(0.2)
    waiting, waited = sender.backlog()
    assert 0 < waiting <= count and waited >= 0.2  # the oldest unsent message's age
    assert not sender.flush(0.05)
    received = []
    for _ in range(count):
        assert reader.poll(WAIT_S), f"message {len(received)} never came"
        received.append(reader.recv()[0])
    assert received == list(range(count))
    assert sender.flush(WAIT_S) and sender.backlog() == (0, 0.0)


def test_a_reader_that_goes_ends_the_writer_and_later_sends_fail(pipe):
    sender, reader = pipe
    for i in range(64):
        sender.send((i, MESSAGE))
    assert sender.backlog()[0] > 0  # the thread is blocked on the full socket
    reader.close()
    deadline = time.monotonic() + WAIT_S
    while sender.running:
        assert time.monotonic() < deadline, "the writer did not end when its reader went"
        time.sleep(0.01)
    assert isinstance(sender.error, OSError) and sender.backlog() == (0, 0.0)
    with pytest.raises(OSError, match="reader is gone"):
        sender.send("late")


def test_close_ends_the_thread_after_the_queued_messages(pipe):
    sender, reader = pipe
    for i in range(3):
        sender.send(i)
    assert sender.close(WAIT_S) and not sender.running
    assert [reader.recv() for _ in range(3) if reader.poll(WAIT_S)] == [0, 1, 2]
    with pytest.raises(OSError, match="closed"):
        sender.send(3)


def test_a_stopped_decode_process_never_blocks_the_front():
    """The decode process is stopped at the first hand-off; its pipe fills after a few more. The
    front keeps prefilling (before, its `conn.send` blocked for good, and its hang check with it),
    then fails the decode engine as hung within transfer_timeout_s, naming the messages waiting;
    every request ends and `close()` returns within JOIN_TIMEOUT_S."""
    timeout_s = 3.0
    engine = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=timeout_s))
    _shrink_send_buffer(engine._conn)
    prompts = ragged_prompts(24, seed=2, min_len=20, max_len=60)
    stop = SignalAtFirstHandOff(signal.SIGSTOP)
    stepped_while_waiting = []
    prefill_step = engine.prefill.step

    def counted_step():
        stepped_while_waiting.append(engine._sender.backlog()[0] > 0)
        return prefill_step()

    engine.prefill.step = counted_step
    result: dict = {}

    def run() -> None:
        try:
            result["done"] = _run(engine, prompts, GREEDY, on_step=stop)
        except BaseException as e:  # noqa: BLE001 (reported by the test's thread)
            result["error"] = e
        result["ended"] = time.monotonic()

    front = threading.Thread(target=run, daemon=True)
    try:
        front.start()
        front.join(timeout_s + 10.0)
        if front.is_alive():  # blocked: killing the decode process frees it
            os.kill(engine.decode_pid, signal.SIGKILL)
            front.join(WAIT_S)
            pytest.fail(f"the front blocked on its pipe: no end {timeout_s + 10.0} s after the decode process stopped")
        assert "error" not in result, result.get("error")
        done = result["done"]
        assert stop.sent_at and result["ended"] - stop.sent_at[0] < timeout_s + 2.0
        assert any(stepped_while_waiting), "no prefill step ran while messages waited for the stopped decode loop"
        assert len(done) == len(prompts)
        errors = [error for _, reasons, error in done.values() if error is not None]
        assert errors and all(reasons[0] in ("length", "abort:error") for _, reasons, _ in done.values())
        assert all(f"the decode engine is hung (pid {engine.decode_pid})" in error for error in errors)
        assert all("message(s) to it waiting to be sent" in error for error in errors)
        assert "transfer_timeout_s=3" in errors[0]
    finally:
        t0 = time.monotonic()
        engine.close()
        assert time.monotonic() - t0 < JOIN_TIMEOUT_S + 2.0
        assert not engine._sender.running
