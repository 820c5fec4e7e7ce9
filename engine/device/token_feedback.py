"""A step's sampled tokens on their way back, for async scheduling (policies/lookahead.py).

To the host: each launched step copies its tokens into one of two pinned buffers (the step
launched after it uses the other) and records an event; `collect` waits on that event alone, so
the host can schedule and launch the next step while this one runs.

To the next step: a step scheduled ahead has decode rows whose input token is still PENDING on the
host, the token its sequence samples in the step before. `sources` finds those rows and the rows
of the previous step's samples that feed them; `apply` copies the tokens device to device into the
step's input ids, after its inputs' upload and before its forward (one small index upload, one
gather, one scatter, all stream-ordered).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

import torch

from engine.device.input_batch import StepPlan
from engine.device.sampler import SampleResult
from policies.lookahead import PENDING

_SEQ = attrgetter("seq")


@dataclass(slots=True)
class Launched:
    """A step on the device. `results` is None until `ModelRunner.collect` (the fast sampling path)."""

    plan: StepPlan
    results: dict[int, SampleResult] | None
    tokens: torch.Tensor | None = None  # [R] int64 on the device, in `plan.sampled` order
    host_tokens: tuple[torch.Tensor, torch.cuda.Event | None] | None = None


@dataclass(slots=True)
class Feedback:
    rows: list[int]  # decode rows of the step whose input token is PENDING
    sources: list[int]  # their rows in `tokens`
    tokens: torch.Tensor  # the previous step's sampled tokens (device)


class TokenFeedback:
    def __init__(self, max_rows: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self._host = [torch.empty(max_rows, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if pinned else None
        self._next = 0
        self._index_host = torch.empty(2 * max_rows, dtype=torch.int64, pin_memory=pinned)
        self._index_device = torch.empty(2 * max_rows, dtype=torch.int64, device=device) if pinned \
            else self._index_host
        self._index_copied = torch.cuda.Event() if pinned else None

    def download(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start the copy of a step's tokens to the host."""
        i, self._next = self._next, self._next ^ 1
        host = self._host[i][:len(tokens)]
        host.copy_(tokens, non_blocking=True)
        event = None
        if self._events is not None:
            event = self._events[i]
            event.record()
        return host, event

    @staticmethod
    def wait(host_tokens: tuple[torch.Tensor, torch.cuda.Event | None],
             await_event: Callable[[torch.cuda.Event], None] = torch.cuda.Event.synchronize) -> list[int]:
        """The tokens, once their copy is done (`await_event` waits for its event)."""
        host, event = host_tokens
        if event is not None:
            await_event(event)
        return host.tolist()

    @staticmethod
    def sources(plan: StepPlan, after: Launched) -> Feedback | None:
        """The rows of `plan` fed by `after`'s samples (None if none is)."""
        seqs = list(map(_SEQ, plan.decodes))
        rows = [i for i, seq in enumerate(seqs) if seq.token_ids[-1] == PENDING]
        for s in plan.prefills:  # a PENDING token can only be a sequence's last
            seq = s.seq
            if seq.token_ids[-1] == PENDING and seq.num_computed_tokens + s.num_new_tokens == len(seq.token_ids):
                raise RuntimeError(f"seq {s.seq.seq_id}: a prefill chunk holds a PENDING token (scheduled "
                                   "ahead past a step that had not computed it)")
        if not rows:
            return None
        if after.tokens is None:
            raise RuntimeError("a step holds PENDING tokens but the step before it has no device tokens "
                               "(it ran the full sampler): it should not have been scheduled ahead")
        prev = {s.seq.seq_id: j for j, s in enumerate(after.plan.sampled)}
        try:
            sources = [prev[seqs[i].seq_id] for i in rows]
        except KeyError as e:
            raise RuntimeError(f"seq {e.args[0]} holds a PENDING token that the step before did not "
                               "sample") from None
        return Feedback(rows, sources, after.tokens)

    def apply(self, feedback: Feedback, input_ids: torch.Tensor) -> None:
        """input_ids[rows] = tokens[sources], on the device's stream."""
        k = len(feedback.rows)
        if self._index_copied is not None:
            self._index_copied.synchronize()  # the last upload has read the host buffer
        host = self._index_host[:2 * k]
        host[:k] = torch.as_tensor(feedback.rows, dtype=torch.int64)
        host[k:] = torch.as_tensor(feedback.sources, dtype=torch.int64)
        index = self._index_device[:2 * k]
        if self._index_copied is not None:
            index.copy_(host, non_blocking=True)
            self._index_copied.record()
        input_ids.index_copy_(0, index[:k], feedback.tokens.index_select(0, index[k:]))
