"""The pair's front posts a KV send while a prefill step runs. `ModelRunner.await_event` hands the
time a step's tokens are awaited to `while_waiting` in slices until the step ends or the work says
it has none; the front's `_while_prefilling` (engine/disagg/pd_front_transfers.py) starts the send
of a `Reserved` that comes meanwhile, keeps every other message of the decode process for the loop's
next turn in the order they came, and waits for nothing once no hand-off awaits an answer. On a GPU
the same path runs end to end in the pair's GPU tests (tests/device/test_disagg_engine_gpu.py)."""
from __future__ import annotations

import multiprocessing
import time
from types import SimpleNamespace

import pytest

from engine.device.model_runner import WAIT_SLICE_S, ModelRunner
from engine.disagg.config import DisaggregationConfig
from engine.disagg.messages import DecodeStep, Refused, Reserved
from engine.disagg.pd_front_transfers import FrontTransfers
from engine.disagg.pipe_receiver import PipeReceiver

WAIT_S = 5.0  # any single wait here


class Event:
    """A CUDA event's host side: not done for `pending` queries."""

    def __init__(self, pending: int) -> None:
        self.pending, self.queries, self.synced = pending, 0, 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.pending

    def synchronize(self) -> None:
        self.synced += 1


def _await(event: Event, work) -> None:
    ModelRunner.await_event(SimpleNamespace(while_waiting=work), event)


def test_the_wait_for_a_step_is_given_to_the_work_in_slices_until_the_step_ends():
    slices: list[float] = []
    event = Event(pending=3)
    _await(event, lambda s: slices.append(s) or True)
    assert slices == [WAIT_SLICE_S] * 3 and event.synced == 1
    assert 0 < WAIT_SLICE_S <= 1e-3  # the step's end is seen within a slice


def test_work_that_expects_none_hands_the_wait_back_and_no_work_means_a_plain_wait():
    event = Event(pending=100)
    calls: list[float] = []
    _await(event, lambda s: calls.append(s) and False)
    assert len(calls) == 1 and event.queries == 1 and event.synced == 1
    plain = Event(pending=100)
    _await(plain, None)
    assert plain.queries == 0 and plain.synced == 1


class Front(FrontTransfers):
    """Only what the front's reads touch; `_start_transfer` recorded, not posted."""

    def __init__(self, receiver: PipeReceiver, awaiting: int) -> None:
        self._failure, self._receiver, self._keep_trace, self._left_for_turn = None, receiver, False, []
        self._handoffs = {f"r{i}": object() for i in range(awaiting)}
        self._sending: set[str] = set()
        self._decoding: dict = {}
        self.started: list[tuple[list[str], bool]] = []
        self.read: list[object] = []

    def _start_transfer(self, message: Reserved, mid_step: bool = False) -> None:
        self.started.append((list(message.request_ids), mid_step))
        self._sending.update(message.request_ids)

    def _decode_outputs(self, outputs):
        self.read.append("step")
        return []

    def _fail_handoff(self, handoff, code, why) -> None:
        self.read.append(code)


@pytest.fixture
def pipe():
    reader, writer = multiprocessing.Pipe(duplex=False)
    receiver = PipeReceiver(reader, "test-receiver")
    yield receiver, writer
    writer.close()
    assert receiver.close(WAIT_S)


def test_a_reserved_answer_mid_step_starts_its_send_and_the_rest_waits_for_the_turn_in_order(pipe):
    receiver, writer = pipe
    front = Front(receiver, awaiting=2)
    writer.send(DecodeStep([]))
    writer.send(Reserved(["r0"], [[7]]))
    writer.send(Refused("r1", "too_long", "no room"))
    deadline = time.monotonic() + WAIT_S
    while len(front._left_for_turn) < 2 and time.monotonic() < deadline:
        assert front._while_prefilling(WAIT_SLICE_S)  # r1 awaits its answer until the Refused is read
    assert front.started == [(["r0"], True)] and front.read == []
    assert [type(m) for m in front._left_for_turn] == [DecodeStep, Refused]
    assert front._take_messages() == []  # the next turn: what was left, in the order it came
    assert front.read == ["step", "too_long"] and front._left_for_turn == []


def test_with_no_hand_off_awaiting_an_answer_the_work_reads_nothing(pipe):
    receiver, writer = pipe
    front = Front(receiver, awaiting=0)
    writer.send(Reserved(["x"], [[1]]))
    assert receiver.poll(WAIT_S)
    start = time.monotonic()
    assert not front._while_prefilling(1.0)
    assert time.monotonic() - start < 0.5 and front.started == [] and receiver.poll(0)  # still in the pipe
    front._failure = "gone"
    front._handoffs = {"r0": object()}
    assert not front._while_prefilling(1.0)  # a failed pair's loop deals with it


def test_a_decode_process_gone_mid_step_hands_the_wait_back(pipe):
    receiver, writer = pipe
    front = Front(receiver, awaiting=1)
    writer.close()
    deadline = time.monotonic() + WAIT_S
    while receiver.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not front._while_prefilling(WAIT_SLICE_S)  # the next turn's read fails the pair


def test_a_link_failed_mid_step_fails_the_pair_at_the_next_turn_not_inside_the_step(pipe):
    """Failing the pair frees prefill blocks, which the prefill step running must not see change:
    the send that meets a failed link is left for the turn, where it fails the pair."""
    from engine.disagg.kv_transfer_message import KVTransferError
    from engine.disagg.pd_front_transfers import FrontTransfers as Real

    class Failing(Front):
        def _start_transfer(self, message, mid_step=False):
            raise KVTransferError("the KV link's peer failed: gone")

        def _fail(self, reason):
            self.read.append(("failed", reason))
            self._failure = reason

    receiver, writer = pipe
    front = Failing(receiver, awaiting=1)
    front._take = Real._take.__get__(front)  # the real dispatch at the turn
    writer.send(Reserved(["r0"], [[3]]))
    deadline = time.monotonic() + WAIT_S
    while not front._left_for_turn and time.monotonic() < deadline:
        if not front._while_prefilling(WAIT_SLICE_S):
            break
    assert [type(m) for m in front._left_for_turn] == [Reserved] and front.read == []
    front._take_messages()
    assert front.read == [("failed", "the KV link's peer failed: gone")] and front._left_for_turn == []


@pytest.mark.parametrize("value", [1, "yes", None])
def test_sends_mid_step_is_checked(value):
    with pytest.raises(ValueError, match=rf"disaggregation.sends_mid_step={value!r} is invalid: must be true or false"):
        DisaggregationConfig(sends_mid_step=value)
    assert DisaggregationConfig().sends_mid_step is True
    assert DisaggregationConfig.parse("prefill=1,decode=1,sends_mid_step=false").sends_mid_step is False
    with pytest.raises(ValueError, match="disaggregation.sends_mid_step='maybe' is invalid: must be true or false"):
        DisaggregationConfig.parse("sends_mid_step=maybe")
