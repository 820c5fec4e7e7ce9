"""Counts of one scheduler step, gathered while scheduling (no extra pass over the batch on the hot
path), and the `steps` trace row built from them in `update` (columns: trace.STEP_COLUMNS)."""
from __future__ import annotations

from dataclasses import dataclass

from policies.blocks.base import BlockUsage
from policies.outputs import SchedulerOutput
from policies.preemption import PreemptionCounts
from policies.queues import QueueSizes
from policies.request import Request


@dataclass(slots=True)
class StepStats:
    """A scheduled chunk is a prefill when it starts with more than one token to compute (as
    `Sequence.is_prefill`), else a decode."""

    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    num_partial: int = 0  # prefill chunks that do not finish their sequence (sample nothing)
    num_chunks: int = 0  # entries counted by add_chunk (admissions, swap-ins, prefills), not add_decodes
    num_running: int = 0  # running sequences when schedule() returned
    num_computed_tokens: int = 0  # over the scheduled sequences, before the step
    num_samples: int = 0

    def add_chunk(self, num_computed: int, uncomputed: int, num_new: int, num_samples: int) -> None:
        self.num_computed_tokens += num_computed
        self.num_samples += num_samples
        self.num_partial += not num_samples
        self.num_chunks += 1
        if uncomputed > 1:
            self.num_prefill_tokens += num_new
            self.num_prefill_seqs += 1
        else:
            self.num_decode_seqs += 1

    def add_decodes(self, num_seqs: int, num_computed: int, num_samples: int) -> None:
        self.num_decode_seqs += num_seqs
        self.num_computed_tokens += num_computed
        self.num_samples += num_samples

    @classmethod
    def of(cls, out: SchedulerOutput, num_running: int) -> StepStats:
        stats = cls(num_running=num_running)
        for seq, num_new, num_samples in out.scheduled:
            computed = seq.num_computed_tokens
            stats.add_chunk(computed, len(seq.token_ids) - computed, num_new, num_samples)
        return stats

    def fill_totals(self, out: SchedulerOutput) -> None:
        """The output's `sum_*` fields, from these counts."""
        out.sum_new_tokens = self.num_prefill_tokens + self.num_decode_seqs
        out.sum_computed_tokens = self.num_computed_tokens
        out.sum_samples = self.num_samples

    def row(self, step: int, out: SchedulerOutput, now: float, queues: QueueSizes,
            usage: BlockUsage, preemptions: PreemptionCounts, ended: list[Request],
            start: float | None = None) -> dict:
        """`start`: when the step began, if not when it was scheduled (`out.now`; a step scheduled
        ahead begins when the one before it ends)."""
        start = out.now if start is None else start
        num_aborted = sum(1 for r in ended if r.finish_reason.startswith("abort:")) if ended else 0
        return {
            "step": step, "time": start, "duration": now - start,
            "num_batched_tokens": self.num_prefill_tokens + self.num_decode_seqs,
            "num_prefill_tokens": self.num_prefill_tokens, "num_prefill_seqs": self.num_prefill_seqs,
            "num_decode_seqs": self.num_decode_seqs, "num_running": queues.running,
            "num_waiting": queues.waiting, "num_swapped": queues.swapped,
            "gpu_blocks_used": usage.gpu_used, "gpu_blocks_total": usage.gpu_total,
            "cpu_blocks_used": usage.cpu_used, "cpu_blocks_total": usage.cpu_total,
            "kv_tokens": queues.kv_tokens, "num_swap_out_blocks": len(out.swap_out),
            "num_swap_in_blocks": len(out.swap_in), "num_copy_blocks": len(out.copy),
            "num_preempted_recompute": preemptions.recompute, "num_preempted_swap": preemptions.swap,
            "num_swap_fallbacks": preemptions.swap_fallbacks, "num_finished": len(ended) - num_aborted,
            "num_aborted": num_aborted, "prefix_hits": usage.prefix_hits,
            "prefix_queries": usage.prefix_queries,
        }
