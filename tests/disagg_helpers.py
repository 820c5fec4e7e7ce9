"""A pure-Python disaggregated pair for tests: one prefill and one decode `Scheduler` stepped in
turn, with the KV store of tests/scheduler_helpers.py on each side and a copy between them, so a
wrong block id on either side fails the decode side's read check."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from itertools import pairwise

from scheduler_helpers import KVStoreBackend, prefix_fingerprints

from policies import Request, Scheduler
from policies.disagg import DecodeSide, KVHandoff, PrefillSide
from policies.lookahead import PENDING


def content_token(seq) -> int:
    """The token a deterministic model samples after `seq`'s tokens (same on every backend)."""
    return 1000 + prefix_fingerprints(seq.token_ids)[-1] % 1000


def sampled(out) -> dict[int, list[int]]:
    tokens = {}
    for e in out.scheduled:
        if e.num_samples:
            base = content_token(e.seq)
            tokens[e.seq.seq_id] = [base + i for i in range(e.num_samples)]
    return tokens


AHEAD_GAP_S = 1e-9  # a step scheduled ahead starts at its predecessor's update (experiments.lab.decode_excess)


def pipeline_breaks(rows: list[dict]) -> tuple[int, int]:
    """Of a decode engine's steps (`DisaggregatedEngine.decode_steps` rows) that follow one leaving
    sequences running: how many have more running than it left (requests received meanwhile), and
    how many were not scheduled ahead (they start after their predecessor's update)."""
    rows = sorted(rows, key=lambda r: r["step"])
    joins = breaks = 0
    for prev, row in pairwise(rows):
        if prev["num_running"]:
            joins += row["num_running"] > prev["num_running"]
            breaks += row["time"] - (prev["time"] + prev["duration"]) > AHEAD_GAP_S
    return joins, breaks


def run_on_device(kv: KVStoreBackend, out) -> dict[int, list[int]]:
    """Execute a decode step scheduled ahead on the fake device once its inputs are known, and sample
    its tokens. A sequence that ended after the step was scheduled (a late stop, an abort) is left
    out: a device writes its dropped token into blocks nothing reuses before that step has run."""
    out = replace(out, scheduled=[e for e in out.scheduled if not e.seq.is_finished])
    for seq, _, num_samples in out.scheduled:
        assert not num_samples or PENDING not in seq.token_ids, "a step ran on a token not yet known"
    kv.execute(out)
    return sampled(out)


class DisaggPair:
    def __init__(self, prefill: Scheduler, decode: Scheduler, max_queue: int | None = None, timeout_s: float = 1e9,
                 abort_at: dict[str, int] | None = None, prefill_ahead: bool = False,
                 decode_ahead: bool = False) -> None:
        """`abort_at`: request id -> the round (one step each side) it is aborted at. `prefill_ahead`:
        the prefill side schedules each step while the one before it runs (`schedule_ahead`, as the
        engine pair's `prefill_async_scheduling`); `prefill_rows` then holds every prefill step's
        (sequence, first position, tokens) as scheduled. `decode_ahead`: the decode side does, as the
        engine pair's decode engine (async scheduling): its KV copies land between the step in
        flight and the next one, as the engine's scatter on its compute stream; `decode_sync_steps`
        counts its steps not scheduled ahead."""
        self.prefill, self.decode = prefill, decode
        self.prefill_ahead, self.decode_ahead = prefill_ahead, decode_ahead
        self.prefill_rows: list[list[tuple]] = []
        self._in_flight_step = None  # the prefill step scheduled ahead, run in the loop's next turn
        self._decode_in_flight = None  # the decode step scheduled ahead and its tokens, updated next turn
        self.decode_sync_steps = 0
        self.pside = PrefillSide(prefill, block_bytes=64, replica=0)
        self.dside = DecodeSide(decode, max_queue=max_queue, timeout_s=timeout_s, replica=1)
        bs = prefill.block_manager.block_size
        self.pkv, self.dkv = KVStoreBackend(bs), KVStoreBackend(bs)
        self.abort_at = dict(abort_at or {})
        self.in_flight: list[KVHandoff] = []  # reserved, copied at the end of the round
        self.ended: dict[str, Request] = {}
        self.events: list[tuple[str, str]] = []  # (what, request id), in order
        self.families: dict[str, list] = {}  # request id -> its sequences on the decode side
        self.now = 0.0

    def _abort(self, rid: str) -> None:
        if self.decode.abort(rid, "user", self.now):
            return
        if self.pside.abort(rid, "user", self.now):
            handoff = self.pside.transferring.get(rid)
            if handoff is not None and self.dside.withdraw(handoff):
                self._end(self.pside.finish_transfer(handoff, self.now))

    def _end(self, request: Request | None) -> None:
        if request is not None:
            assert request.request_id not in self.ended, f"{request.request_id} ended twice"
            self.ended[request.request_id] = request

    @staticmethod
    def _has_work(sched: Scheduler) -> bool:
        """Requests to run, or ends (an abort of a waiting request) that only an update returns."""
        return sched.has_unfinished() or sched.lifecycle.has_pending_ends

    def _step(self, sched: Scheduler, kv: KVStoreBackend) -> None:
        if not self._has_work(sched):
            return
        out = sched.schedule(self.now)
        kv.execute(out)
        for request in sched.update(out, sampled(out), self.now + 0.5):
            self._end(request)
        sched.check_invariants()

    def _scheduled(self, out) -> tuple:
        """A prefill step as scheduled: noted, run at once (its KV written, its tokens sampled from
        the tokens it sees, as a device runs it before a later look-past appends PENDING tokens; a
        decode's PENDING input would fail the reads)."""
        self.prefill_rows.append([(seq, seq.num_computed_tokens, num_new) for seq, num_new, _ in out.scheduled])
        self.pkv.execute(out)
        return out, sampled(out)

    def _step_prefill_ahead(self, aborts: list[str]) -> None:
        sched, step, self._in_flight_step = self.prefill, self._in_flight_step, None
        if step is None:
            if not self._has_work(sched):
                for rid in aborts:
                    self._abort(rid)
                return
            step = self._scheduled(sched.schedule(self.now))
        nxt = sched.schedule_ahead(self.now + 0.25)
        if nxt is not None and not nxt.is_empty:
            self._in_flight_step = self._scheduled(nxt)
        for rid in aborts:
            self._abort(rid)
        out, tokens = step
        for request in sched.update(out, tokens, self.now + 0.5):
            self._end(request)
        sched.check_invariants()

    def _step_decode_ahead(self) -> None:
        """One turn of the decode engine's loop with async scheduling: the step in flight (or a new
        one, synchronous), its successor scheduled ahead, then its update; the successor runs on
        the fake device once the tokens it reads are known (after that update)."""
        sched, step, self._decode_in_flight = self.decode, self._decode_in_flight, None
        if step is None:
            if not self._has_work(sched):
                return
            out = sched.schedule(self.now)
            self.decode_sync_steps += bool(out.scheduled)
            step = (out, run_on_device(self.dkv, out))
        nxt = sched.schedule_ahead(self.now + 0.25)
        out, tokens = step
        for request in sched.update(out, tokens, self.now + 0.5):
            self._end(request)
        sched.check_invariants()
        if nxt is not None and not nxt.is_empty:
            self._decode_in_flight = (nxt, run_on_device(self.dkv, nxt))

    def run(self, requests: list[Request], max_rounds: int = 5000) -> dict[str, Request]:
        for r in requests:
            self.prefill.add(r, self.now)
        for round_ in range(max_rounds):
            due = [rid for rid, at in self.abort_at.items() if at == round_]
            if self.prefill_ahead:  # aborted while the step looked past runs (its prefills ended, not handed off)
                self._step_prefill_ahead(due)
            else:
                for rid in due:
                    self._abort(rid)
                self._step(self.prefill, self.pkv)
            for handoff in self.pside.take_handoffs():
                self.events.append(("handoff", handoff.request_id))
                if not self.dside.enqueue(handoff, self.now):
                    self.pside.abort(handoff.request_id, "handoff_queue_full", self.now)
                    self._end(self.pside.finish_transfer(handoff, self.now))
            reserved, never = self.dside.reserve_ready(self.now)
            for handoff in never:
                self.pside.abort(handoff.request_id, "too_long", self.now)
                self._end(self.pside.finish_transfer(handoff, self.now))
            for handoff in reserved:
                assert len(handoff.dst_block_ids) == handoff.num_blocks
                self.events.append(("reserved", handoff.request_id))
                handoff.transfer_start_time = self.now
            if self.decode_ahead:
                self._step_decode_ahead()
            else:
                self._step(self.decode, self.dkv)
            for handoff in self.in_flight:  # the copy of the round before: block by block
                for src, dst in zip(handoff.block_ids, handoff.dst_block_ids):
                    self.dkv.gpu[dst] = list(self.pkv._block(self.pkv.gpu, src))
                self.events.append(("received", handoff.request_id))
                family = self.dside.receive(handoff, self.now + 0.25)
                if family is not None:
                    self.families[handoff.request_id] = family
                self._end(self.pside.finish_transfer(handoff, self.now + 0.25))
            self.decode.check_invariants()
            self.prefill.check_invariants()
            self.in_flight = reserved
            self.now += 1.0
            if not (self.prefill.has_unfinished() or self.decode.has_unfinished() or self.in_flight
                    or self.dside.queue or self.pside.transferring or self._in_flight_step is not None
                    or self._decode_in_flight is not None):
                return self.ended
        raise AssertionError("the pair made no progress")


@dataclass(slots=True)
class SignalAtFirstHandOff:
    """An `on_step` hook for a `DisaggregatedEngine`: sends `sig` to its decode process once a request
    has been handed off to it, noting when (`time.monotonic()`) in `sent_at`."""
    sig: int
    sent_at: list[float] = field(default_factory=list)

    def __call__(self, engine) -> None:
        if not self.sent_at and engine._decoding:
            os.kill(engine.decode_pid, self.sig)
            self.sent_at.append(time.monotonic())
