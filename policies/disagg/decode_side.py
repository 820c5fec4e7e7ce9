"""The decode side of a hand-off: a decode replica's `Scheduler` receiving requests whose prompt
was computed elsewhere.

    side = DecodeSide(scheduler, max_queue=None, timeout_s=60.0, replica=1)
    side.enqueue(handoff, now)               # False: a bounded queue is full (the caller aborts it)
    for handoff in side.reserve_ready(now):  # blocks allocated BEFORE any byte is sent
        ...  send handoff.block_ids -> handoff.dst_block_ids ...
        side.receive(handoff, now)           # the request joins the running batch
    side.expire(now)                         # hand-offs queued longer than timeout_s (caller aborts them)

Admission: hand-offs wait here in FIFO order (`queue`) until the head fits: no sequence of this
replica waiting or swapped (its preempted sequences come first), sequence slots left under
`max_num_seqs` (the running queue's plus those reserved), and the block manager admits its prompt +
first token (`can_allocate`, with the watermark). `reserve_ready` then allocates the blocks; call it
after every event that frees blocks here (a step's update) and after `enqueue`.

Backpressure: while a hand-off waits, the prefill side keeps its KV blocks, so a decode side that
is short of sequence slots or blocks fills the prefill side's pool and holds back its next prompts,
as vLLM's and llm-d's prefill instances keep a finished prefill's KV until the decode instance
reads it. The wait is bounded in time (`timeout_s`: the caller aborts the expired ones) and, with
`max_queue` set, in number: a hand-off that finds `max_queue` waiting is refused (load shedding);
None (the default): no bound in number.

`receive` makes the request a live request of this scheduler: its sequences join the running queue
with `num_computed_tokens` = the prompt's length and their first token, so the next step scheduled
decodes them (scheduling ahead, the step after the one in flight: `SchedulerConfig.join_ahead`,
policies/lookahead.py; the backend writes their KV before it launches that step); the trace row
(written here when it ends) carries the prefill side's queueing, the split columns
(HANDOFF_COLUMNS) and TTFT = now - arrival. From then on it is an ordinary running request:
a preemption here swaps it out or recomputes prompt + outputs on this replica; `Scheduler.abort`
ends it. A hand-off aborted before `receive` (its `abort_reason` set) gives its reserved blocks
back on `receive` and never becomes live here.
"""
from __future__ import annotations

import math
from collections import deque

from policies.blocks.base import AllocStatus
from policies.disagg.handoff import KVHandoff
from policies.request import is_int
from policies.sequence import Sequence, SequenceStatus


def check_max_queue(value: object, key: str) -> int | None:
    """A hand-off queue's bound: an integer >= 1, or None (unbounded: backpressure alone)."""
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"{key}={value!r} is invalid: must be an integer >= 1 (hand-offs waiting on one decode "
                         "replica, more are aborted) or null (unbounded: they wait, their KV held by the prefill "
                         "side, up to the timeout)")
    return value


class DecodeSide:
    def __init__(self, scheduler, max_queue: int | None = None, timeout_s: float = 60.0, replica: int = 0) -> None:
        check_max_queue(max_queue, "max_queue")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: must be a number of seconds > 0")
        self.scheduler = scheduler
        self.max_queue = max_queue
        self.timeout_s = float(timeout_s)
        self.replica = replica
        scheduler.lifecycle.transfer_sides.append(self)
        self.queue: deque[tuple[float, KVHandoff]] = deque()  # (enqueued at, hand-off), FIFO
        self._families: dict[str, list[Sequence]] = {}  # request id -> its sequences to be, while queued
        self._reserved: dict[str, list[Sequence]] = {}  # request id -> its sequences, blocks allocated
        self._reserved_slots = 0

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def enqueue(self, handoff: KVHandoff, now: float) -> bool:
        """Queue a hand-off routed here; False (nothing queued; the caller aborts it) when a bounded
        queue has `max_queue` waiting."""
        handoff.decode_replica = self.replica
        if self.max_queue is not None and len(self.queue) >= self.max_queue:
            return False
        self.queue.append((now, handoff))
        self._families[handoff.request_id] = self._build(handoff)
        return True

    def withdraw(self, handoff: KVHandoff) -> bool:
        """Take a queued hand-off out (its request was aborted); False if it is not queued here."""
        for i, (_, queued) in enumerate(self.queue):
            if queued is handoff:
                del self.queue[i]
                del self._families[handoff.request_id]
                return True
        return False

    def expire(self, now: float) -> list[KVHandoff]:
        """Take out the hand-offs queued for `timeout_s` or more (FIFO: they are at the head)."""
        expired = []
        while self.queue and now - self.queue[0][0] >= self.timeout_s:
            expired.append(self._pop())
        return expired

    def reserve_ready(self, now: float) -> tuple[list[KVHandoff], list[KVHandoff]]:
        """Allocate blocks for the queued hand-offs that fit, head first, stopping at the first that
        does not. Returns (reserved: start their transfers, never: too long for this replica's KV
        pool even idle; the caller aborts them)."""
        sched = self.scheduler
        queues, config, block_manager = sched.queues, sched.config, sched.block_manager
        reserved, never = [], []
        while self.queue:
            handoff = self.queue[0][1]
            n, family = len(handoff.first_token_ids), self._families[handoff.request_id]
            status = AllocStatus.NEVER if n > config.max_num_seqs else block_manager.can_allocate(family[0])
            if status is AllocStatus.NEVER:
                never.append(self._pop())
                continue
            if status is not AllocStatus.OK or queues.waiting or queues.swapped \
                    or queues.running_cost + self._reserved_slots + n > config.max_num_seqs:
                break
            self._pop()
            block_manager.allocate(family[0])
            for child in family[1:]:
                block_manager.fork(family[0], child)
            handoff.dst_block_ids = list(family[0].block_table[:handoff.num_blocks])
            handoff.reserved_time = now
            self._reserved[handoff.request_id] = family
            self._reserved_slots += n
            reserved.append(handoff)
        return reserved, never

    def receive(self, handoff: KVHandoff, now: float) -> list[Sequence] | None:
        """The KV of `handoff` is here: its request joins the running batch (module docstring), its
        sequences returned; None for an aborted hand-off (its blocks given back)."""
        family = self._reserved.pop(handoff.request_id, None)
        if family is None:
            raise ValueError(f"hand-off of {handoff.request_id!r} has no blocks reserved on replica {self.replica}: "
                             "call reserve_ready first (the receiver allocates before the send)")
        self._reserved_slots -= len(family)
        sched = self.scheduler
        if handoff.abort_reason is not None:
            for seq in family:
                sched.block_manager.free(seq)
            return None
        handoff.transfer_end_time = now
        for seq in family:
            seq.num_computed_tokens = handoff.num_computed_tokens
        sched.block_manager.mark_computed(family[0])
        sched.recorder.take_over(handoff.request, handoff.first_scheduled_time, handoff.num_preemptions,
                                 handoff.row_columns(), now)
        for seq in family:
            reason = handoff.finished_samples.get(seq.sample_index)
            if reason is not None:  # it stopped on the prefill side: it holds no blocks here
                sched.block_manager.free(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED_STOPPED, reason
        sched.lifecycle.adopt(handoff.request, family, now)
        return family

    def _pop(self) -> KVHandoff:
        handoff = self.queue.popleft()[1]
        del self._families[handoff.request_id]
        return handoff

    @property
    def holds_blocks(self) -> bool:
        """Whether blocks are reserved here for a hand-off on its way."""
        return bool(self._reserved)

    def held_sequences(self) -> list[Sequence]:
        """Sequences whose blocks are reserved for a hand-off on its way (the block manager's
        invariants count them)."""
        return [seq for family in self._reserved.values() for seq in family]

    def _build(self, handoff: KVHandoff) -> list[Sequence]:
        """The request's sequences as they will run here: prompt + first token, not yet computed
        (the block manager sizes them; `receive` sets their progress)."""
        lifecycle = self.scheduler.lifecycle
        parent = Sequence.from_request(lifecycle.new_seq_id(), handoff.request)
        parent.token_ids.append(handoff.first_token_ids[0])
        family = [parent]
        for index, token in enumerate(handoff.first_token_ids[1:], start=1):
            child = parent.fork(lifecycle.new_seq_id(), index)
            child.token_ids[-1] = token
            family.append(child)
        return family
