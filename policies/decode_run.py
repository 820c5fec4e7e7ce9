"""Fast-forward over runs of decode steps: the work behind `Scheduler.decode_run_limit` and
`Scheduler.advance_decodes` (used by the simulator; the engine learns a step's tokens by running it).

A decode run is a stretch of steps in which the whole running queue decodes one token per step and
nothing else happens: no sequence waits or is swapped out (so none is admitted or swapped in), no
step preempts, copies a block or lacks one, and only the last step may finish sequences. Such steps
differ only in their clock and in totals that grow by the batch size per step, so a backend that
knows their times beforehand (the simulator: its latency model prices them, and it knows when the
next request arrives) can apply K of them in one call. That leaves exactly the state and trace that
K schedule()/update() pairs leave: the same tokens, block tables and prefix cache, token times,
events, ended requests and step rows (kept compact by the recorder, see `DecodeRunSteps`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from policies import lookahead
from policies.output_lens import decode_steps_before_output_len
from policies.outputs import SchedulerOutput
from policies.phase_state import SchedulerState
from policies.step_stats import StepStats
from policies.trace import DecodeRunSteps


class Permit(NamedTuple):
    """What `decode_run_limit` allowed: `limit` steps at once, of which the first `quiet` finish
    nothing (quiet >= limit - 1), asked at scheduler step `step` with `num_seen` requests added."""

    limit: int
    quiet: int
    step: int
    num_seen: int


NO_RUN = Permit(0, 0, -1, 0)
# A run step's output as its trace row reads it (no swaps, no copies); never handed out or changed.
_PLAIN = SchedulerOutput(0.0)


def run_limit(state: SchedulerState, step: int, max_steps: int, token: int,
              output_lens: Mapping[str, int] | None) -> Permit:
    """`Scheduler.decode_run_limit`, for a scheduler whose running sequences all have one token to
    compute: the next steps that schedule the whole running queue as plain decodes, and how many of
    them finish nothing."""
    queues, lifecycle = state.queues, state.lifecycle
    running = queues.running
    # Each running sequence samples one token (no unforked parallel prompt: its cost would be n),
    # the whole queue fits the token budget, and nothing waits to be admitted or swapped in.
    if (not running or queues.waiting or queues.swapped or queues.running_cost != len(running)
            or len(running) > state.config.max_num_batched_tokens or lifecycle.has_pending_ends
            or max_steps < 1):
        return NO_RUN
    quiet = lifecycle.decode_steps_before_stop(running, token, max_steps - 1)
    if quiet is None:
        return NO_RUN
    if quiet and output_lens:
        forced = decode_steps_before_output_len(running, output_lens)
        if forced is not None and forced < quiet:
            quiet = forced
    return Permit(state.block_manager.decode_run_limit(running, quiet + 1), quiet, step, len(lifecycle.seen))


class AheadDecision(NamedTuple):
    """How a run hands over to the step after it when the backend schedules ahead (that step is
    decided at the run's last step's start, before that step's update)."""

    possible: Callable[[], bool]  # whether scheduling ahead would have looked past the last step
    decide: Callable[[], None]  # decide the next step


def advance(state: SchedulerState, permit: Permit, step: int, times: list[float], token: int,
            output_lens: Mapping[str, int] | None, ahead: AheadDecision | None = None) -> bool:
    """`Scheduler.advance_decodes`: steps step, step + 1, ...; past `permit.quiet` of them, the last
    one applies the stop rules. Requests added since the permit arrived during the last step, or,
    with `ahead` (scheduling ahead), before its start. Returns whether the next step was decided.

    With `ahead` and `ahead.possible()` (judged when the last step's progress is in, before its
    endings): the last step is looked past as `schedule_ahead` would at its start (the sequences a
    length rule ends leave the queue and free their blocks: `permit.quiet` counted no step where a
    sequence may stop on `token`), the next step is decided, and then the last step's update ends
    those requests and records its row (the queues and blocks as its look-past left them)."""
    num_steps = len(times) - 1
    queues, lifecycle, block_manager, preemptor = state.queues, state.lifecycle, state.block_manager, state.preemptor
    if not 1 <= num_steps <= permit.limit or permit.step != step or lifecycle.has_pending_ends \
            or len(queues.waiting) != len(lifecycle.seen) - permit.num_seen:
        raise ValueError(f"advance_decodes got {num_steps} steps: decode_run_limit allowed "
                         f"{permit.limit if permit.step == step else 0} since the last step (and no abort)")
    finishing = num_steps > permit.quiet
    running = queues.running
    num_seqs = len(running)
    preemptor.begin_step()  # forgets the counts of a preempting step before the run
    lifecycle.append_decode_run(running, token, times)
    gpu_used = block_manager.append_decode_run(running, num_steps)
    stats = StepStats(num_decode_seqs=num_seqs, num_running=num_seqs, num_samples=num_seqs)
    kv_tokens = queues.kv_tokens
    queues.kv_tokens = kv_tokens + num_seqs * num_steps
    decides = ahead is not None and ahead.possible()
    plain = num_steps - 1 if finishing or decides else num_steps  # steps before one with its own row
    if plain:
        queues.kv_tokens = kv_tokens + num_seqs  # as the first step's update leaves it
        first = stats.row(step, _PLAIN, times[1], queues.sizes(), block_manager.usage(), preemptor.counts, [],
                          start=times[0])
        queues.kv_tokens = kv_tokens + num_seqs * num_steps
        # Requests in the waiting queue arrived during the last step (the caller's contract).
        run = DecodeRunSteps(first, times, gpu_used, num_seqs, len(queues.waiting)) if plain == num_steps else \
            DecodeRunSteps(first, times[:-1], gpu_used[:-1], num_seqs, 0)
        state.recorder.decode_run(run)
    if decides:
        retired = lookahead.retire(state, lifecycle.length_endings(running, output_lens)) if finishing else []
        sizes, usage, counts = queues.sizes(), block_manager.usage(), preemptor.counts
        ahead.decide()
        lifecycle.end_retired(retired, times[-1])
        state.recorder.step(stats.row(step + plain, _PLAIN, times[-1], sizes, usage, counts, lifecycle.take_ended(),
                                      start=times[-2]))
    elif finishing:
        lifecycle.finish_decode_run(list(running), token, times[-1], output_lens)
        state.recorder.step(stats.row(step + plain, _PLAIN, times[-1], queues.sizes(), block_manager.usage(),
                                      preemptor.counts, lifecycle.take_ended(), start=times[-2]))
    return decides
