"""Step 1 of `Scheduler.schedule`: the running queue, in policy order.

Decodes first (one token each; when KV runs out, the policy's victim among running sequences not yet
scheduled is preempted), then the next chunk of running prefills from the remaining token budget.
The hot path is a steady decode of the whole running queue: one block-manager call for the batch,
and the batch's entries reused while the running queue is unchanged.
"""
from __future__ import annotations

from operator import attrgetter, itemgetter

from policies.outputs import ScheduledSeq
from policies.phase_state import ScheduledStep, SchedulerState
from policies.sequence import Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING
_entry_computed = attrgetter("seq.num_computed_tokens")
_entry_samples = itemgetter(2)


class RunningPass:
    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        # The entries of the last full decode batch and their total samples, with the running
        # queue's version they are valid for.
        self._batch_entries: tuple[int, list[ScheduledSeq], int] = (-1, [], 0)

    def schedule(self, step: ScheduledStep, budget: int, all_decoding: bool) -> tuple[int, bool]:
        """Schedule the running sequences within `budget` tokens; returns the budget left and whether
        anything was preempted. `all_decoding`: every running sequence has one token to compute."""
        running = self.state.queues.running
        if not running:
            return budget, False
        if all_decoding:
            decodes, prefills = running, []
        else:
            decodes = [seq for seq in running if len(seq.token_ids) - seq.num_computed_tokens == 1]
            prefills = [seq for seq in running if len(seq.token_ids) - seq.num_computed_tokens != 1] \
                if len(decodes) < len(running) else []
        if len(decodes) > budget:
            decodes = decodes[:budget]
        # Hot path: one block-manager call for the whole decode batch when it surely fits.
        copies = self.state.block_manager.append_decode_slots(decodes) if decodes else []
        preempted = False
        if copies is not None:
            step.out.copy.extend(copies)
            self._push_decode_batch(step, decodes)
            budget -= len(decodes)
        else:
            budget, preempted = self._one_by_one(step, list(decodes), budget, decode=True)
            entries = step.out.scheduled
            step.stats.add_decodes(len(entries), sum(map(_entry_computed, entries)),
                                   sum(map(_entry_samples, entries)))
        if prefills and budget:
            budget, preempted_prefill = self._one_by_one(step, prefills, budget, decode=False)
            preempted = preempted or preempted_prefill
        return budget, preempted

    def _push_decode_batch(self, step: ScheduledStep, decodes: list[Sequence]) -> None:
        """Schedule decodes that all got their slots. The batch of the whole running queue is reused
        while the queue is unchanged, and its computed tokens are the queue's running total."""
        queues = self.state.queues
        whole = decodes is queues.running
        version, entries, samples = self._batch_entries
        if not whole or version != queues.running_version:
            entries = list(map(self.state.lifecycle.decode_entries.__getitem__, decodes))
            samples = sum(map(_entry_samples, entries))
            if whole:
                self._batch_entries = (queues.running_version, entries, samples)
        step.out.scheduled.extend(entries)
        computed = queues.kv_tokens if whole else sum(map(_entry_computed, entries))
        step.stats.add_decodes(len(entries), computed, samples)

    def _one_by_one(self, step: ScheduledStep, seqs: list[Sequence], budget: int,
                    decode: bool) -> tuple[int, bool]:
        """Reserve slots sequence by sequence, preempting victims when KV runs out."""
        state = self.state
        block_manager, out, preempted = state.block_manager, step.out, False
        chunked = state.config.enable_chunked_prefill
        for seq in seqs:
            if not budget:
                break
            if seq.status is not RUNNING:
                continue  # a victim of this step
            chunk = len(seq.token_ids) - seq.num_computed_tokens
            if chunk > budget:
                if not chunked:
                    continue
                chunk = budget
            if not block_manager.can_append_slots(seq, chunk):
                preempted = True
                if not state.preemptor.make_room(seq, chunk, out, out.now):
                    continue
            out.copy.extend(block_manager.append_slots(seq, chunk))
            if decode:
                out.scheduled.append(state.lifecycle.decode_entries[seq])
            else:
                step.push_chunk(seq, chunk)
            budget -= chunk
        return budget, preempted
