"""What `Scheduler.schedule(now)` hands the backend: the step contract (docs/architecture.md).

The backend executes, in order: `swap_out`, `swap_in`, `copy`, then the forward over `scheduled`.
For each `ScheduledSeq` it computes `num_new_tokens` tokens starting at `seq.num_computed_tokens`
(read during execution; the scheduler advances it in `update`) and, if `num_samples > 0`, samples
that many tokens from the last computed position (n > 1 for the prompt of a parallel-sampling
request; 0 for a prefill chunk that does not finish the prompt).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from policies.request import Request
from policies.sequence import Sequence


class SameTokens(dict):
    """`Scheduler.update`'s new_token_ids for a step in which every sampling entry sampled one token,
    the same `tokens` (a one-element list) for every sequence: answered for any seq id as a missing
    key, so a backend builds nothing per step and the update reads `tokens` once."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]) -> None:
        super().__init__()
        if not isinstance(tokens, list) or len(tokens) != 1:
            raise ValueError(f"tokens={tokens!r} is invalid: SameTokens holds a list of exactly one token")
        self.tokens = tokens

    def __missing__(self, seq_id: int) -> list[int]:
        return self.tokens


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int
    num_samples: int


@dataclass(slots=True)
class SchedulerOutput:
    now: float
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: dict[int, int] = field(default_factory=dict)  # gpu block -> cpu block
    swap_in: dict[int, int] = field(default_factory=dict)  # cpu block -> gpu block
    copy: list[tuple[int, int]] = field(default_factory=list)  # (src gpu block, dst gpu block)
    preempted: list[Sequence] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)
    ahead: bool = False  # decided by schedule_ahead while the step before it ran (async scheduling)
    # Sums over `scheduled` of num_new_tokens, of seq.num_computed_tokens (before the step) and of
    # num_samples, kept by the scheduler while it builds the batch so that per-step consumers (the
    # simulator's latency model) need no pass over it; None on an output built by hand.
    sum_new_tokens: int | None = None
    sum_computed_tokens: int | None = None
    sum_samples: int | None = None
    # Every entry decodes one token of a sequence that has sampled before, so that no entry computes
    # a prompt token (a one-token prompt, or a prompt's last token, looks like a decode otherwise);
    # False where the scheduler does not know it.
    decode_only: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_out or self.swap_in or self.copy)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.seq.is_prefill)

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for s in self.scheduled if not s.seq.is_prefill)

    @property
    def num_prefill_seqs(self) -> int:
        return len(self.scheduled) - self.num_decode_seqs
