"""Per-sequence state. A request with n > 1 has n sequences once its prompt is done (forked, sharing
the prompt's KV blocks copy-on-write); until then it has one.

Token accounting (used by the scheduler, both backends and the kernels' metadata):
- `token_ids` = prompt + generated tokens; `num_computed_tokens` = how many of them have KV in cache.
- A step computes `num_new_tokens` tokens starting at position `num_computed_tokens`. When that
  reaches `num_tokens`, the step also samples the next token(s) from the last position.
- Decode is the case `num_tokens - num_computed_tokens == 1`. After a recompute preemption
  `num_computed_tokens` drops to 0 and the next "prefill" re-computes prompt + generated tokens.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from policies.request import Request

PENDING = -1  # the token of a step scheduled past (policies/lookahead.py) until its update writes it


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Index among the request's sequences (0 = the one that ran the prompt); children are forked.
    sample_index: int = 0
    # Order in which the scheduler accepted the request (ties between equal arrival times).
    arrival_index: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort:<why>"
    # Prompt tokens found in the prefix cache at the first allocation (a caching block manager sets
    # it; None: not allocated yet, or no prefix cache). Served as usage's cached_tokens.
    num_cached_tokens: int | None = None

    @classmethod
    def from_request(cls, seq_id: int, request: Request) -> Sequence:
        prompt = list(request.prompt_token_ids)
        return cls(seq_id=seq_id, request=request, token_ids=prompt, num_prompt_tokens=len(prompt))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return len(self.token_ids) - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED

    def fork(self, seq_id: int, sample_index: int) -> Sequence:
        """A child with the same tokens and progress; the block manager shares its blocks."""
        return Sequence(seq_id=seq_id, request=self.request, token_ids=list(self.token_ids),
                        num_prompt_tokens=self.num_prompt_tokens, status=self.status,
                        num_computed_tokens=self.num_computed_tokens, block_table=[],
                        sample_index=sample_index, arrival_index=self.arrival_index)
