"""Scheduling one step ahead (vLLM v1's async scheduling): the work behind `Scheduler.schedule_ahead`.

The next step is decided while the last one still runs on the device, so the backend's host work
(scheduling, input preparation, launches) overlaps the device's instead of adding to it:

    out_1 = schedule(t0)
    out_2 = schedule_ahead(t1)       # while out_1 runs: out_1's progress is applied here
    update(out_1, tokens_1, t2)      # out_1's tokens, token-based stop rules, trace events
    out_3 = schedule_ahead(t2)       # while out_2 runs
    update(out_2, tokens_2, t3) ...

`schedule_ahead` returns None, changing nothing, when the step in flight cannot be looked past;
the caller then runs the synchronous loop for that step (update, then schedule).

Known before the tokens: every sampling sequence gets one token (a placeholder, PENDING, in its
`token_ids` until the update writes the sampled value), and the length rules (max_tokens,
max_model_len, forced output lengths) end sequences at a known step. Such a sequence leaves the
running queue and frees its blocks when its step is looked past (the device runs the step in
flight before anything scheduled later, so a reused block is written after it), and is recorded
as finished at the update, with that step's time. Not known: a stop token or stop string. It ends
its sequence at the update, one step late: the sequence also sits in the next step, already in
flight, whose result for it is dropped (as an abort in flight), and that next step is then updated
synchronously.

A step is looked past only if nothing in the next one could need its tokens or a preemption: no
parallel-sampling prompt forks in it, no sequence was aborted since it was scheduled, every running
sequence is in it (or joined since, below) and samples on the device alone (the engine's full
sampler returns its tokens at once: policies/sampling_path.py), the block manager surely has the
next step's slots (a decode for each running sequence, the next chunk for each prompt not finished
by its chunk here), and the policy would not force running sequences out for the waiting queue's
head. A prompt's next chunk needs no token of this step (its tokens are the prompt's), so a chunked
prefill is scheduled ahead too, as vLLM v1 does: its host work overlaps the device's instead of
adding to every chunk's step.

Joins (`SchedulerConfig.join_ahead`, on by default): a sequence that joined the running queue after
the step was scheduled (`Lifecycle.adopt`: a decode replica's received hand-off, its prompt's KV in
its blocks, its first token sampled on the prefill side) needs nothing of the step in flight: its
next input token is known on the host and its KV was written before the next step is launched (the
engine pair scatters a receive on the compute stream, behind the step in flight and ahead of the
next one, so the device orders them, not the host). So it joins the step after the one in flight,
which is scheduled ahead as usual, instead of making that step synchronous. With `join_ahead` off
any join makes the step in flight synchronous (its successor is scheduled after its update).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from operator import itemgetter

from policies.blocks.base import BlockUsage
from policies.outputs import SchedulerOutput
from policies.phase_state import ScheduledStep, SchedulerState
from policies.preemption import PreemptionCounts
from policies.queues import QueueSizes
from policies.sampling_path import device_sampling
from policies.sequence import PENDING, Sequence, SequenceStatus
from policies.step_stats import StepStats

__all__ = ["PENDING", "LookedPast", "can_look_past", "joins_ready", "look_past", "next_chunks_fit", "next_step_safe",
           "retire", "samples_on_device"]  # PENDING: for backends
_SEQ = itemgetter(0)  # ScheduledSeq.seq
RUNNING = SequenceStatus.RUNNING


@dataclass(slots=True)
class LookedPast:
    """A step whose progress `look_past` applied; its update finishes it."""

    out: SchedulerOutput
    stats: StepStats
    counts: PreemptionCounts
    start: float  # when the step began on the device: the previous update's time
    sampled: list[Sequence] = field(default_factory=list)  # one PENDING token each, in order
    ending: list[Sequence] = field(default_factory=list)  # finished by a length rule
    # The step's trace row describes the state its own progress left (as a synchronous update
    # does), not the next step's admissions and slots, which come before this update.
    queues: QueueSizes | None = None
    usage: BlockUsage | None = None


def can_look_past(state: SchedulerState, step: ScheduledStep) -> bool:
    """Whether the step after `step` can be scheduled before `step`'s tokens are known (module
    docstring), judged from the state before `look_past` (which only shrinks the running queue)."""
    out, stats, lifecycle = step.out, step.stats, state.lifecycle
    if not out.scheduled:
        return False  # nothing runs: the caller waits for work (an arrival) synchronously
    if lifecycle.aborted_in_flight or stats.num_samples != len(out.scheduled) - stats.num_partial:
        return False  # an abort in flight, or a prompt sampling n > 1 (it forks)
    joined = joins_ready(state)
    if joined is None or len(out.scheduled) + joined != len(state.queues.running):
        return False  # a running sequence is not in the step (its turn, or a preemption, may come next)
    if not samples_on_device(state, map(_SEQ, out.scheduled)):
        return False  # the full sampler returns this step's tokens to the host at once
    if stats.num_partial and not next_chunks_fit(state, out):
        return False
    return next_step_safe(state, ahead=1)


def joins_ready(state: SchedulerState) -> int | None:
    """How many running sequences joined since the last schedule() (module docstring: joins), each
    holding its next input token on the host (one token to compute, not PENDING), so the next step
    decodes it whatever the step in flight samples; None if one does not, or if any joined with
    `join_ahead` off."""
    joined = state.lifecycle.joined
    if not joined:
        return 0
    if not state.config.join_ahead:
        return None
    for seq in joined:
        if seq.status is not RUNNING or len(seq.token_ids) - seq.num_computed_tokens != 1 \
                or seq.token_ids[-1] == PENDING:
            return None
    return len(joined)


def next_chunks_fit(state: SchedulerState, out: SchedulerOutput) -> bool:
    """With prompts that this step's chunks do not finish: whether the next step surely has the GPU
    blocks for every running sequence's decode slot and each such prompt's next chunk (at most the
    token budget), plus one block per chunk for a partly filled or shared last block, so that it
    preempts nothing. A bound from the free count alone: a block manager that reserves ahead
    (contiguous) may be refused a look-past it could have had, never granted one it cannot serve."""
    block_size, budget = state.block_manager.block_size, state.config.max_num_batched_tokens
    need = len(state.queues.running)
    for seq, num_new, num_samples in out.scheduled:
        if not num_samples:
            left = len(seq.token_ids) - seq.num_computed_tokens - num_new
            need += -(-min(left, budget) // block_size) + 1
    return state.block_manager.num_free_gpu_blocks() >= need


def samples_on_device(state: SchedulerState, seqs: Iterable[Sequence]) -> bool:
    """Whether a step of `seqs` keeps its tokens on the device, so the step after it can be decided
    while it runs (policies/sampling_path.py; no live request may need the full sampler: no check)."""
    return not state.lifecycle.num_full_sampler or device_sampling(seqs)


def next_step_safe(state: SchedulerState, ahead: int) -> bool:
    """With every running sequence decoding: the next step can neither preempt nor need a token it
    does not have (the running sequences have computed `ahead` tokens fewer than they will have)."""
    queues = state.queues
    if state.lifecycle.aborted_in_flight:
        return False
    if state.may_force and queues.waiting and state.preemptor.would_force(
            queues.waiting[0], state.config.max_num_seqs):
        return False
    return state.block_manager.decode_slots_fit(queues.running, ahead=ahead)


def look_past(state: SchedulerState, step: ScheduledStep, start: float,
              output_lens: Mapping[str, int] | None) -> LookedPast:
    """Apply `step`'s progress as if it had run (tokens PENDING), and end its sequences that reach a
    length rule (recorded at the update)."""
    lifecycle, queues, block_manager = state.lifecycle, state.queues, state.block_manager
    out, stats = step.out, step.stats
    past = LookedPast(out, stats, state.preemptor.counts, start)
    ending = lifecycle.look_past(out, output_lens, past.sampled)
    queues.kv_tokens += stats.num_prefill_tokens + stats.num_decode_seqs
    past.ending = retire(state, ending)
    past.queues = queues.sizes()
    past.usage = block_manager.usage()
    return past


def retire(state: SchedulerState, ending: list[tuple[Sequence, SequenceStatus, str]]) -> list[Sequence]:
    """Sequences a length rule ends in a step looked past: they leave the running queue and free their
    blocks now, with their final status; their requests end at the step's update (`Lifecycle.end_retired`)."""
    retired = []
    for seq, status, reason in ending:
        state.queues.remove(seq)
        state.lifecycle.release_blocks(seq, reason)
        seq.status, seq.finish_reason = status, reason
        retired.append(seq)
    return retired
