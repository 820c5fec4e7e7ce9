"""The hand-off objects between the `Scheduler` and its phases (the running pass, admission, the
look-past of async scheduling, decode runs): each phase is a function of the state it is handed,
never of the Scheduler, and adds to the step being built only through `ScheduledStep`.
"""
from __future__ import annotations

from dataclasses import dataclass

from policies.blocks.base import BlockManager
from policies.lifecycle import Lifecycle
from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.preemption import Preemptor
from policies.queues import SchedulerQueues, seq_cost
from policies.request import Request
from policies.scheduler_config import SchedulerConfig
from policies.sequence import Sequence
from policies.step_stats import StepStats
from policies.trace import TraceRecorder


@dataclass(slots=True, frozen=True)
class SchedulerState:
    """What the phases schedule from: budgets and limits, the queues (kept in policy order, the one
    place sequences are ordered), the KV blocks, preemption, the sequences' lifecycle and the trace."""

    config: SchedulerConfig
    queues: SchedulerQueues
    block_manager: BlockManager
    preemptor: Preemptor
    lifecycle: Lifecycle
    recorder: TraceRecorder
    may_force: bool  # the policy may force running sequences out for the waiting queue's head


@dataclass(slots=True)
class ScheduledStep:
    """A step being scheduled, then awaiting its update: the output and its counts, kept together."""

    out: SchedulerOutput
    stats: StepStats

    def push_chunk(self, seq: Sequence, chunk: int) -> None:
        """Schedule a chunk of `seq`'s tokens (its slots reserved) and count it."""
        uncomputed = len(seq.token_ids) - seq.num_computed_tokens
        # A chunk that completes the sequence samples: n tokens for an unforked parallel prompt.
        samples = seq_cost(seq) if chunk == uncomputed else 0
        self.out.scheduled.append(ScheduledSeq(seq, chunk, samples))
        self.stats.add_chunk(seq.num_computed_tokens, uncomputed, chunk, samples)

    def drop_request(self, request: Request) -> None:
        """Take an ended request's entries out of the step (a sibling of one aborted mid-step)."""
        out = self.out
        if any(entry.seq.request is request for entry in out.scheduled):
            out.scheduled[:] = [entry for entry in out.scheduled if entry.seq.request is not request]
            self.stats = StepStats.of(out, 0)
