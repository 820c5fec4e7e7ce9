"""Which sequences a step can sample on the device alone (temperature scaling, then a draw), so
that its tokens may stay there while the next step is scheduled (policies/lookahead.py).

Everything else needs the engine's full sampler, whose results come back to the host at once:
logprobs, top-k, top-p, min-p, a seeded draw, presence / frequency / repetition penalties (they
read the sequence's tokens so far), and min_tokens not yet reached (stop tokens are masked).  The engine's sampler and the scheduler's look-ahead both ask this module, so the
simulator schedules ahead exactly where the engine can.
"""
from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policies.request import SamplingParams
    from policies.sequence import Sequence

_PARAMS = attrgetter("request.sampling_params")
_DECIDING = attrgetter("logprobs", "top_k", "top_p", "min_p", "seed", "min_tokens", "temperature",
                       "presence_penalty", "frequency_penalty", "repetition_penalty")


def _filters(logprobs, top_k, top_p, min_p, seed, temperature, presence, frequency, repetition) -> bool:
    return (logprobs is not None or top_k > 0 or top_p < 1.0 or min_p > 0 or (seed is not None and temperature > 0)
            or presence != 0 or frequency != 0 or repetition != 1.0)


def may_need_full_sampler(params: SamplingParams) -> bool:
    """Whether a request's sequences may need the full sampler at some step (the scheduler counts
    such live requests, so that steps without any skip the per-sequence check)."""
    p = params
    return p.min_tokens > 0 or _filters(p.logprobs, p.top_k, p.top_p, p.min_p, p.seed, p.temperature,
                                        p.presence_penalty, p.frequency_penalty, p.repetition_penalty)


def device_sampling(seqs: Iterable[Sequence]) -> bool:
    """Whether every sequence samples its next token on the device alone (asked before the step's
    tokens are applied).  Each distinct combination of the deciding fields is checked once.  A
    simulator decode run scheduling ahead is checked once, at its first step: its sequences'
    fields do not change and their output counts only grow."""
    seqs = list(seqs)
    params = list(map(_PARAMS, seqs))
    any_min_tokens = False
    for logprobs, top_k, top_p, min_p, seed, min_tokens, temperature, *penalties in set(map(_DECIDING, params)):
        if _filters(logprobs, top_k, top_p, min_p, seed, temperature, *penalties):
            return False
        any_min_tokens = any_min_tokens or bool(min_tokens)
    return not any_min_tokens or all(s.num_output_tokens >= p.min_tokens for s, p in zip(seqs, params))
