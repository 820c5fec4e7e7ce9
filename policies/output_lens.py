"""Forced output lengths (workload replay): a request recorded with N output tokens ends after its
N-th token with finish_reason "stop", as if it had sampled its EOS there. Both backends apply this
one rule through `Scheduler.update(..., stop_seq_ids)`."""
from __future__ import annotations

from collections.abc import Mapping

from policies.outputs import ScheduledSeq


def reaching_output_len(scheduled: list[ScheduledSeq], output_lens: Mapping[str, int]) -> list[int]:
    """Seq ids whose token sampled this step reaches their request's output length."""
    stops = []
    for seq, _, num_samples in scheduled:
        if num_samples:
            stop = output_lens.get(seq.request.request_id)
            if stop is not None and seq.num_output_tokens + 1 >= stop:
                stops.append(seq.seq_id)
    return stops
