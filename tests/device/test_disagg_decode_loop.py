"""The decode process's admission turn (`DecodeLoop._admit`) against a fake link and pipe: what it
tells the front and what it posts on the link, in which order."""
from __future__ import annotations

from types import SimpleNamespace

from disagg_helpers import sampled
from scheduler_helpers import make_scheduler, request

from engine.disagg.decode_process import DecodeLoop
from policies.disagg import DecodeSide, PrefillSide


class RecordingLink:
    def __init__(self, events: list) -> None:
        self.events = events

    def recv(self, parts, k_caches):
        self.events.append(("recv", [key for key, _ in parts]))
        return SimpleNamespace(keys=[key for key, _ in parts])


class RecordingPipe:
    def __init__(self, events: list) -> None:
        self.events = events

    def send(self, message) -> None:
        self.events.append((type(message).__name__, list(getattr(message, "request_ids", []))))


def handed_off(rids: list[str]):
    prefill = make_scheduler(num_gpu_blocks=64)
    pside = PrefillSide(prefill, block_bytes=8)
    for rid in rids:
        prefill.add(request(rid, 6, max_tokens=4), 0.0)
    out = prefill.schedule(0.0)
    prefill.update(out, sampled(out), 1.0)
    return pside.take_handoffs()


def test_the_front_is_told_before_the_receive_is_posted():
    """`Reserved` leaves first, so posting the receive overlaps the answer's way to the front; the
    blocks are allocated before either, and one answer and one receive carry both hand-offs."""
    events: list = []
    decode = make_scheduler(num_gpu_blocks=64)
    side = DecodeSide(decode, replica=1)
    engine = SimpleNamespace(now=lambda: 1.0, runner=SimpleNamespace(kv_cache=SimpleNamespace(k_caches=[None])))
    loop = DecodeLoop(engine, side, RecordingLink(events), RecordingPipe(events), max_in_flight=2, max_blocks=64)
    free = decode.block_manager.num_free_gpu_blocks()
    for handoff in handed_off(["a", "b"]):
        assert side.enqueue(handoff, 1.0)
        loop.queued[handoff.request_id] = handoff
    loop._admit()
    assert events == [("Reserved", ["a", "b"]), ("recv", ["a", "b"])]
    assert decode.block_manager.num_free_gpu_blocks() == free - 4
    assert loop.in_flight == 1 and set(loop.receiving) == {"a", "b"} and not loop.queued
