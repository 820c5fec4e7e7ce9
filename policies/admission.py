"""Step 2 of `Scheduler.schedule`: serving the swapped and waiting queues, merged in policy order.

Swapped sequences are swapped in, waiting ones admitted (their blocks allocated, prefix-cached
tokens skipped), while the token budget, `max_num_seqs` and the block manager allow. The first one
that must wait stops the walk (head-of-line: no request overtakes an earlier one); one that can
never fit is aborted as `too_long`; this step's preemption victims are not taken back.
"""
from __future__ import annotations

from policies.blocks.base import AllocStatus
from policies.phase_state import ScheduledStep, SchedulerState
from policies.preemption import merge_block_map
from policies.queues import seq_cost
from policies.sequence import Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING
LATER, NEVER = AllocStatus.LATER, AllocStatus.NEVER


def admit(state: SchedulerState, step: ScheduledStep, budget: int, take_waiting: bool,
          take_swapped: bool) -> tuple[int, bool]:
    """Swap in / admit from the swapped and waiting queues merged in policy order.
    Returns the remaining budget and whether anything was scheduled."""
    queues, block_manager, config, recorder = state.queues, state.block_manager, state.config, state.recorder
    key, victims, out = queues.key, state.preemptor.victims, step.out
    now = out.now
    num_scheduled = len(out.scheduled)
    swapped_in: list[tuple[Sequence, int]] = []
    while budget > 0:
        waiting = queues.waiting[0] if take_waiting and queues.waiting else None
        swapped = queues.swapped[0] if queues.swapped else None
        from_swap = swapped is not None and (waiting is None or key(swapped) < key(waiting))
        if from_swap and not take_swapped:
            break
        seq = swapped if from_swap else waiting
        if seq is None or (victims and seq in victims):
            break
        cost = seq_cost(seq)
        need = len(seq.token_ids) - seq.num_computed_tokens
        if queues.running_cost + cost > config.max_num_seqs or (
                need > budget and not config.enable_chunked_prefill):
            break
        status = block_manager.can_swap_in(seq) if from_swap else block_manager.can_allocate(seq)
        if status is LATER and not queues.running and not state.lifecycle.blocks_in_transfer():
            status = NEVER  # the GPU pool holds no running sequence nor a transfer's: waiting cannot help
        if status is NEVER:  # it can never fit: aborted, with its siblings' entries of this step
            state.lifecycle.abort(seq.request, "too_long", now)
            step.drop_request(seq.request)
            continue
        if status is LATER:
            break
        if from_swap:
            queues.swapped.popleft()
            merge_block_map(out.swap_in, block_manager.swap_in(seq), "swap_in")
            queues.add_running(seq)
            recorder.swapped_in(seq, now)
            # Slots are reserved after all swap-ins: a sibling swapped in later this step can
            # then share the blocks this one brought back instead of copying them again.
            swapped_in.append((seq, min(need, budget)))
            budget -= min(need, budget)
            continue
        queues.waiting.popleft()
        block_manager.allocate(seq)  # may skip prefix-cached tokens
        queues.add_running(seq)
        recorder.scheduled(seq, now)
        chunk = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
        out.copy.extend(block_manager.append_slots(seq, chunk))
        step.push_chunk(seq, chunk)
        budget -= chunk
    for seq, chunk in swapped_in:  # the block table may lack the slot of the next token
        if seq.status is not RUNNING:
            continue  # aborted with a too_long sibling
        if block_manager.can_append_slots(seq, chunk):
            out.copy.extend(block_manager.append_slots(seq, chunk))
            step.push_chunk(seq, chunk)
        else:
            budget += chunk  # stays running; the next step's decode pass handles it
    return budget, len(out.scheduled) > num_scheduled

