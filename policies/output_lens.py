"""Forced output lengths (workload replay): a request recorded with N output tokens ends after its
N-th token with finish_reason "stop", as if it had sampled its EOS there. Both backends apply this
one rule through `Scheduler.update(..., stop_seq_ids)`."""
from __future__ import annotations

from collections.abc import Mapping

from policies.outputs import ScheduledSeq
from policies.sequence import Sequence


def reaching_output_len(scheduled: list[ScheduledSeq], output_lens: Mapping[str, int]) -> list[int]:
    """Seq ids whose token sampled this step reaches their request's output length."""
    stops = []
    for seq, _, num_samples in scheduled:
        if num_samples:
            stop = output_lens.get(seq.request.request_id)
            if stop is not None and seq.num_output_tokens + 1 >= stop:
                stops.append(seq.seq_id)
    return stops


def decode_steps_before_output_len(seqs: list[Sequence], output_lens: Mapping[str, int]) -> int | None:
    """How many decode steps of `seqs` (one token each) run before the first step in which one
    reaches its output length (not counted); None when no seq has one."""
    limit = None
    for seq in seqs:
        stop = output_lens.get(seq.request.request_id)
        if stop is not None:
            steps = max(stop - seq.num_output_tokens - 1, 0)
            if limit is None or steps < limit:
                limit = steps
    return limit


def holds_output_len(seq: Sequence, output_lens: Mapping[str, int]) -> bool:
    """Whether seq, with this step's token appended, has reached its request's output length (the
    same rule as `reaching_output_len`, applied after the update instead of before it)."""
    stop = output_lens.get(seq.request.request_id)
    return stop is not None and seq.num_output_tokens >= stop
