"""Preemption: whom to take off the GPU, and how, by swap or by recompute (vLLM v0 semantics).

Victims are the policy's pick among running sequences not yet scheduled in the step (`make_room`),
or, before scheduling, running sequences the waiting head may preempt (`force_for`, priority).

- swap: its blocks move to the CPU pool (`out.swap_out`) and it waits in the swapped queue; when
  the CPU pool cannot take them it falls back to recompute, and the trace says so
  (`preempted` event with mode "recompute_fallback", step counter `num_swap_fallbacks`).
- recompute: its blocks are freed, `num_computed_tokens` drops to 0 (prompt and generated tokens
  are recomputed later) and it goes back to the waiting queue at its policy position. Victims join
  the waiting queue when the step ends, so they are not re-admitted by the step that evicted them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from policies.blocks.base import AllocStatus, BlockManager
from policies.outputs import SchedulerOutput
from policies.policy.base import Policy
from policies.queues import SchedulerQueues, seq_cost
from policies.sequence import Sequence, SequenceStatus
from policies.trace import TraceRecorder

logger = logging.getLogger("servelab.scheduler")
WARN_EVERY = 50  # vLLM logs a warning every 50 preemptions


def merge_block_map(step_map: dict[int, int], mapping: dict[int, int], name: str) -> None:
    """Add one sequence's block copies to the step's; a source block copied to two places in one
    step cannot be expressed by the output's dict, so that is a block-manager bug, loudly."""
    for src, dst in mapping.items():
        if step_map.setdefault(src, dst) != dst:
            raise RuntimeError(f"out.{name} would copy block {src} to both {step_map[src]} and {dst} "
                               f"in one step")


@dataclass(slots=True)
class PreemptionCounts:
    """Preemptions of one step. Swap fallbacks are also counted in `recompute`."""

    recompute: int = 0
    swap: int = 0
    swap_fallbacks: int = 0


class Preemptor:
    def __init__(self, queues: SchedulerQueues, block_manager: BlockManager, policy: Policy,
                 recorder: TraceRecorder) -> None:
        self.queues = queues
        self.block_manager = block_manager
        self.policy = policy
        self.recorder = recorder
        self._default_victim = type(policy).pick_victim is Policy.pick_victim
        self._tail_victim = self._default_victim and policy.may_preempt_suffix  # force_for's victim
        self.total = 0
        self.total_fallbacks = 0  # swaps that fell back to recompute
        self.counts = PreemptionCounts()
        self.victims: set[Sequence] = set()  # preempted this step
        self._to_waiting: list[Sequence] = []

    def begin_step(self) -> None:
        if self.victims:  # the last step preempted: fresh counts (else they are all still 0)
            self.victims = set()
            self.counts = PreemptionCounts()

    def end_step(self) -> None:
        if self._to_waiting:
            for seq in self._to_waiting:
                self.queues.add_waiting(seq)
            self._to_waiting.clear()

    def pick_victim(self, candidates: list[Sequence]) -> Sequence:
        """`candidates` are in running (policy) order, so the default victim (max key) is the last."""
        return candidates[-1] if self._default_victim else self.policy.pick_victim(candidates)

    def make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput, now: float) -> bool:
        """Preempt victims among running sequences not scheduled this step until seq's slots fit;
        False if seq itself was the victim."""
        scheduled = {entry.seq for entry in out.scheduled}
        while True:
            victim = self.pick_victim([s for s in self.queues.running if s not in scheduled])
            self.preempt(victim, out, now)
            if victim is seq:
                return False
            if self.block_manager.can_append_slots(seq, num_tokens):
                return True

    def force_for(self, head: Sequence, out: SchedulerOutput, now: float, max_num_seqs: int) -> None:
        """Before anything is scheduled: let the waiting head push out running sequences the policy
        allows it to (`may_preempt`), least urgent first, until it fits (priority scheduling)."""
        queues = self.queues
        if self._swapped_first(head):
            return  # the swapped head is served first anyway
        may_preempt = self.policy.may_preempt
        while queues.running:
            if self._fits(head, max_num_seqs):
                return
            if self._tail_victim:  # the allowed ones are a suffix, and the victim the last of them
                tail = queues.running[-1]
                victim = tail if may_preempt(head, tail) else None
            else:
                allowed = [seq for seq in queues.running if may_preempt(head, seq)]
                victim = self.pick_victim(allowed) if allowed else None
            if victim is None:
                return
            self.preempt(victim, out, now)

    def would_force(self, head: Sequence, max_num_seqs: int) -> bool:
        """Whether `force_for(head)` would preempt a sequence now (nothing is changed)."""
        running = self.queues.running
        if not running or self._swapped_first(head):
            return False
        may_preempt = self.policy.may_preempt
        return not self._fits(head, max_num_seqs) and any(may_preempt(head, seq) for seq in running)

    def _swapped_first(self, head: Sequence) -> bool:
        queues = self.queues
        return bool(queues.swapped) and queues.key(queues.swapped[0]) < queues.key(head)

    def _fits(self, head: Sequence, max_num_seqs: int) -> bool:
        return (self.queues.running_cost + seq_cost(head) <= max_num_seqs
                and self.block_manager.can_allocate(head) is not AllocStatus.LATER)

    def preempt(self, seq: Sequence, out: SchedulerOutput, now: float) -> None:
        self.queues.remove(seq)
        seq.num_preemptions += 1
        self.total += 1
        out.preempted.append(seq)
        self.victims.add(seq)
        mode = self.policy.preemption_mode
        if mode == "swap":
            if self.block_manager.can_swap_out(seq):
                merge_block_map(out.swap_out, self.block_manager.swap_out(seq), "swap_out")
                self.queues.add_swapped(seq)
                self.counts.swap += 1
                self.recorder.preempted(seq, "swap", now)
                self.recorder.swapped_out(seq, now)
                self._warn(seq, "swap")
                return
            mode = "recompute_fallback"
            self.counts.swap_fallbacks += 1
            self.total_fallbacks += 1
        self.counts.recompute += 1
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._to_waiting.append(seq)
        self.recorder.preempted(seq, mode, now)
        self._warn(seq, mode)

    def _warn(self, seq: Sequence, mode: str) -> None:
        """Every WARN_EVERY preemptions, say how this one was done (a swap that found the CPU pool
        full fell back to recompute) and how many fell back so far."""
        if self.total % WARN_EVERY:
            return
        how = "recompute (the CPU swap pool could not take its blocks)" if mode == "recompute_fallback" else mode
        fallbacks = (f", {self.total_fallbacks} of them swaps that fell back to recompute"
                     if self.total_fallbacks else "")
        logger.warning(
            "Sequence %d of request %r was preempted by %s (%d preemptions in total%s): the KV cache "
            "is too small for this load; raise num_gpu_blocks or lower max_num_seqs / "
            "max_num_batched_tokens.", seq.seq_id, seq.request.request_id, how, self.total, fallbacks)

    def discard(self, seq: Sequence) -> bool:
        """Forget a recompute victim of this step (being aborted before it re-queues); False if
        seq is not one."""
        if seq in self._to_waiting:
            self._to_waiting.remove(seq)
            return True
        return False
