"""The front's pipe to the decode process never blocks the front, either way. `PipeSender`
(engine/disagg/pipe_sender.py) keeps the order of the messages, returns at once while the reader does
not read, reports how many wait and for how long, and ends its thread when the reader goes; a pair
whose decode process is stopped mid-run keeps stepping its prefill engine, fails the decode engine
as hung within transfer_timeout_s naming the messages left waiting, ends every request and closes
within its bound. `PipeReceiver` (engine/disagg/pipe_receiver.py) keeps the order of the messages,
never waits on a message begun and unfinished and reports for how long it has been, and ends its
thread when the writer goes, mid-message or not; a decode process stopped mid-write (at start-up or
mid-run) or leaving aborted hand-offs unanswered is failed within its bound, naming what was seen,
every request ends and its prefill blocks are freed. Every wait here is bounded (a blocked front is
detected, not waited for)."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time

import pytest
from disagg_helpers import SignalAtFirstHandOff
from disagg_pipe_helpers import stopping_at, write_begun, write_rest
from engine_helpers import ragged_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples
from test_disagg_engine import ARGS, GREEDY, _run

from engine.disagg import decode_client
from engine.disagg.config import DisaggregationConfig
from engine.disagg.pd_engine import JOIN_TIMEOUT_S, DisaggregatedEngine
from engine.disagg.pipe_receiver import PipeReceiver
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


class _CountingConn:
    """A `Connection` whose `send_bytes` (the sender thread's writes) are counted."""

    def __init__(self, conn) -> None:
        self.conn, self.thread_writes = conn, 0

    def send_bytes(self, data) -> None:
        self.thread_writes += 1
        self.conn.send_bytes(data)

    def fileno(self) -> int:
        return self.conn.fileno()


def test_a_message_with_nothing_before_it_leaves_from_the_callers_thread():
    """No wait for the thread (and the interpreter lock it needs): the socket takes the message at
    once; behind a message the socket took only in part, the rest and what follows go by the
    thread, in order."""
    ours, theirs = multiprocessing.Pipe()
    _shrink_send_buffer(ours)
    conn = _CountingConn(ours)
    sender = PipeSender(conn, "test-pipe-direct")
    try:
        sender.send(("small", 1))
        assert sender.backlog() == (0, 0.0) and conn.thread_writes == 0
        assert theirs.poll(WAIT_S) and theirs.recv() == ("small", 1)
        big = [(i, bytes([i]) * 50_000) for i in range(4)]  # far more than the socket holds
        _bounded(lambda: [sender.send(m) for m in big])
        assert sender.backlog()[0] >= 1  # the first's tail, then the others, wait for the reader
        assert [theirs.recv() for _ in big if theirs.poll(WAIT_S)] == big
        assert sender.flush(WAIT_S) and conn.thread_writes == len(big) - 1  # the tail is a raw write
    finally:
        theirs.close()
        assert sender.close(WAIT_S)
        ours.close()


def test_a_one_way_pipe_goes_through_the_thread():
    reader, writer = multiprocessing.Pipe(duplex=False)
    if _is_socket(writer):
        pytest.skip("this platform's one-way pipe is a socket")
    conn = _CountingConn(writer)
    sender = PipeSender(conn, "test-pipe-oneway")
    try:
        for i in range(3):
            sender.send(i)
        assert [reader.recv() for _ in range(3) if reader.poll(WAIT_S)] == [0, 1, 2]
        assert sender.flush(WAIT_S) and conn.thread_writes == 3
    finally:
        assert sender.close(WAIT_S)
        reader.close()
        writer.close()


def _is_socket(conn) -> bool:
    try:
        socket.socket(fileno=os.dup(conn.fileno())).close()
    except OSError:
        return False
    return True


@settings(max_examples=examples(20), deadline=None)
@given(st.lists(st.integers(1, 120_000), min_size=1, max_size=12))
def test_messages_of_any_size_arrive_whole_and_in_order(sizes):
    """Direct writes, partial ones and the thread's, mixed: the reader gets every message as sent."""
    ours, theirs = multiprocessing.Pipe()
    _shrink_send_buffer(ours)
    sender = PipeSender(ours, "test-pipe-sizes")
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(theirs.recv() for _ in sizes), daemon=True)
    try:
        sent = [(i, bytes([i % 251]) * n) for i, n in enumerate(sizes)]
        reader.start()
        for message in sent:
            sender.send(message)
        reader.join(WAIT_S)
        assert not reader.is_alive() and got == sent
    finally:
        theirs.close()
        assert sender.close(WAIT_S)
        ours.close()


def test_a_stopped_decode_process_never_blocks_the_front():
    """The decode process is stopped at the first hand-off; its pipe fills after a few more. The
    front keeps prefilling (before, its `conn.send` blocked for good, and its hang check with it),
    then fails the decode engine as hung within transfer_timeout_s, naming the messages waiting;
    every request ends and `close()` returns within JOIN_TIMEOUT_S."""
    timeout_s = 3.0
    engine = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=timeout_s))
    _shrink_send_buffer(engine._decode.conn)
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


@pytest.fixture
def reader_pipe():
    ours, theirs = multiprocessing.Pipe()
    receiver = PipeReceiver(ours, "test-pipe-receiver")
    yield receiver, theirs
    theirs.close()  # the thread reads the end of file and ends
    assert receiver.close(WAIT_S)
    ours.close()


def test_the_receiver_keeps_the_order_and_never_waits_on_a_message_begun(reader_pipe):
    receiver, writer = reader_pipe
    count = 64  # 256 KB: read while it is written
    for i in range(count):
        writer.send((i, MESSAGE))
    big = pickle.dumps(("big", b"y" * (1 << 20)))
    write_begun(writer, big, len(big) // 2)  # the writer stops mid-message
    received = []
    for _ in range(count):
        assert receiver.poll(WAIT_S), f"message {len(received)} never came"
        received.append(receiver.recv()[0])
    assert received == list(range(count))
    assert not receiver.poll(0.2)  # begun, not whole: `Connection.poll` is True here, and its recv blocks
    assert receiver.incomplete() >= 0.2
    with pytest.raises(BlockingIOError):
        receiver.recv()
    write_rest(writer, big, len(big) // 2)
    assert receiver.poll(WAIT_S) and receiver.recv()[0] == "big"
    assert receiver.incomplete() == 0.0


def test_a_message_arriving_while_the_caller_holds_the_thread_back_is_waited_for(reader_pipe):
    """`poll(0, arriving_s)`: a message whose bytes have come, which the reader thread has not queued
    (held back here by its lock, as by the interpreter lock a busy caller holds), is waited for at
    most `arriving_s`; with nothing on the way it does not wait, and a message begun long ago (a
    writer stopped mid-message) is not waited for either."""
    receiver, writer = reader_pipe
    with receiver._changed:  # the thread cannot queue (nor mark a message begun) until this lets go
        writer.send("held")
        time.sleep(0.1)
        assert not receiver._queue and receiver._arriving()  # its bytes are here, not yet queued
        start = time.monotonic()
        assert receiver.poll(0, WAIT_S)  # waiting lets the thread read and queue it
        assert time.monotonic() - start < 1.0 and receiver.recv() == "held"
    start = time.monotonic()
    assert not receiver.poll(0, 0.5) and time.monotonic() - start < 0.1  # nothing on the way
    write_begun(writer, b"w" * 1000, 10)
    time.sleep(1.1)  # begun over a second ago: a stopped writer, not a message arriving
    start = time.monotonic()
    assert not receiver.poll(0, 0.5) and time.monotonic() - start < 0.1
    write_rest(writer, b"w" * 1000, 10)
    assert receiver.poll(WAIT_S)


def test_the_fronts_read_waits_for_an_arriving_message_once_a_turn():
    """`_take_messages` waits for a message on its way in only before its first read of a turn: a
    decode process whose messages keep coming never holds the front's loop."""
    from engine.disagg.messages import DecodeStep
    from engine.disagg.pd_front_transfers import ARRIVING_S, FrontTransfers

    class Receiver:
        def __init__(self) -> None:
            self.waits: list[float] = []
            self.left = 5  # messages that keep coming while the front reads

        def poll(self, timeout_s: float = 0.0, arriving_s: float = 0.0) -> bool:
            self.waits.append(arriving_s)
            return self.left > 0

        def recv(self):
            self.left -= 1
            return DecodeStep([])

    class Front(FrontTransfers):
        def __init__(self) -> None:  # only what a turn's reads touch
            self._failure, self._receiver, self._keep_trace, self._left_for_turn = None, Receiver(), False, []

        def _decode_outputs(self, outputs):
            return []

    front = Front()
    assert front._take_messages() == []
    assert front._receiver.waits == [ARRIVING_S, 0.0, 0.0, 0.0, 0.0, 0.0] and ARRIVING_S > 0


def test_a_writer_gone_mid_message_ends_the_receiver(reader_pipe):
    receiver, writer = reader_pipe
    writer.send("whole")
    write_begun(writer, b"z" * 1000, 10)
    writer.close()
    assert receiver.poll(WAIT_S) and receiver.recv() == "whole"
    assert receiver.poll(WAIT_S)  # the end of file, as `Connection.poll` says it
    with pytest.raises(EOFError, match="writer is gone"):
        receiver.recv()
    assert receiver.close(WAIT_S) and isinstance(receiver.error, OSError) and receiver.incomplete() == 0.0


def _bounded_front(fn, bound_s: float, pids) -> dict:
    """`fn()` on a thread: {"value"} or {"error"}, and "ended" (`time.monotonic()`). Fails the test if
    it has not returned within `bound_s` (it blocked), after killing the processes `pids()` names
    (the decode process: a read blocked on it ends)."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (reported by the test's thread)
            result["error"] = e
        result["ended"] = time.monotonic()

    front = threading.Thread(target=run, daemon=True)
    front.start()
    front.join(bound_s)
    if front.is_alive():
        for pid in pids():
            os.kill(pid, signal.SIGKILL)
        front.join(WAIT_S)
        pytest.fail(f"the front blocked on its pipe: no end within {bound_s} s")
    return result


def _decode_pids() -> list[int]:
    return [p.pid for p in multiprocessing.active_children() if p.name == "servelab-decode"]


def test_a_decode_process_stopped_mid_message_never_blocks_the_front(monkeypatch):
    """The decode process stops (SIGSTOP) halfway through writing its first outputs. The front never
    waits on that message (before, its `recv` blocked for good, and its hang checks with it): it
    fails the decode engine as hung within transfer_timeout_s, naming the message begun; every
    request ends with that error and `close()` returns within JOIN_TIMEOUT_S."""
    monkeypatch.setattr(decode_client, "decode_main", stopping_at("DecodeStep"))
    timeout_s = 3.0
    engine = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=timeout_s))
    prompts = ragged_prompts(8, seed=3, min_len=5, max_len=40)
    try:
        result = _bounded_front(lambda: _run(engine, prompts, GREEDY), timeout_s + 30.0, _decode_pids)
        assert "error" not in result, result.get("error")
        done = result["value"]
        assert len(done) == len(prompts)
        assert all(reasons == ["abort:error"] for _, reasons, _ in done.values())
        for _, _, error in done.values():
            assert f"the decode engine is hung (pid {engine.decode_pid})" in error
            assert "still incomplete (it stopped writing mid-message)" in error
            assert "transfer_timeout_s=3" in error
    finally:
        t0 = time.monotonic()
        engine.close()
        assert time.monotonic() - t0 < JOIN_TIMEOUT_S + 2.0
        assert not engine._receiver.running and not engine._sender.running


def test_a_decode_process_stopped_mid_message_at_start_up_fails_the_start_up(monkeypatch):
    """The decode process stops halfway through writing `DecodeReady`: the pair's start-up fails
    within transfer_timeout_s (before, the front's `recv` blocked for good), naming the message
    begun, and the decode process is ended."""
    monkeypatch.setattr(decode_client, "decode_main", stopping_at("DecodeReady"))
    timeout_s = 5.0

    def start() -> None:
        DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=timeout_s)).close()

    result = _bounded_front(start, 60.0, _decode_pids)
    error = result.get("error")
    assert isinstance(error, TimeoutError), error
    assert "did not finish running the KV link's start-up transfer within transfer_timeout_s=5.0" in str(error)
    assert "still incomplete (it stopped writing mid-message)" in str(error)
    assert not _decode_pids()


def test_aborted_hand_offs_left_unanswered_fail_the_decode_engine_and_free_their_blocks(monkeypatch):
    """The decode process stops as it reads the first hand-offs, and the user aborts them all (their
    outputs go out at once): nothing decodes there, but their prefill blocks are held until the
    decode side answers. Its silence fails it as hung within transfer_timeout_s (before, the pair
    waited for the answer for good, never idle) and the blocks are freed."""
    monkeypatch.setattr(decode_client, "decode_main", stopping_at("HandoffBatch", mid_write=False))
    timeout_s = 3.0
    engine = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=timeout_s))
    try:
        prompts = ragged_prompts(4, seed=4, min_len=3, max_len=6)  # one prefill step: handed off at once
        for i, prompt in enumerate(prompts):
            engine.add_request(f"a-{i}", prompt, GREEDY)
        ended, aborted_at = {}, None
        deadline = time.monotonic() + timeout_s + 20.0
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the aborted hand-offs never ended: their blocks stay held"
            ended.update((out.request_id, out) for out in engine.step() if out.finished)
            if aborted_at is None and engine._decoding:
                assert len(engine._decoding) == len(prompts)
                for request_id in list(engine._decoding):
                    assert engine.abort_request(request_id)
                aborted_at = time.monotonic()
        assert time.monotonic() - aborted_at < timeout_s + 2.0
        assert sorted(ended) == [f"a-{i}" for i in range(len(prompts))]
        assert all(out.outputs[0].finish_reason == "abort:user" for out in ended.values())
        assert f"the decode engine is hung (pid {engine.decode_pid})" in engine._failure
        assert f"with {len(prompts)} aborted hand-off(s) awaiting its answer" in engine._failure
        assert engine.prefill.scheduler.block_manager.num_free_gpu_blocks() == engine.prefill.runner.num_gpu_blocks
        with pytest.raises(RuntimeError, match="hung"):
            engine.add_request("late", prompts[0], GREEDY)
    finally:
        engine.close()


def test_each_message_keeps_when_its_bytes_came(reader_pipe):
    """`last_arrival`: when the reader thread saw the first bytes of the message `recv` gave last,
    not when the caller took it (experiments/lib/answer_timing.py splits an answer's wait there)."""
    receiver, writer = reader_pipe
    assert receiver.last_arrival is None
    sent_a = time.monotonic()
    writer.send("a")
    time.sleep(0.2)
    writer.send("b")
    time.sleep(0.2)
    assert receiver.poll(WAIT_S) and receiver.recv() == "a"
    arrived_a = receiver.last_arrival
    assert receiver.poll(WAIT_S) and receiver.recv() == "b"
    assert sent_a <= arrived_a < sent_a + 0.15  # seen as it came, 0.4 s before it was taken
    assert receiver.last_arrival - arrived_a > 0.15
