"""`StopRule`: when one sequence ends, checked for each token it samples (vLLM's order: a stop
condition wins over a length limit).

- once the sequence has >= min_tokens outputs: the request's eos_token_id (unless ignore_eos), a
  token in stop_token_ids, or the backend's word that the token completed a stop string (or a
  forced output length) -> FINISHED_STOPPED "stop";
- max_tokens outputs, or num_tokens >= max_model_len -> FINISHED_LENGTH "length";
- on a prefill replica of a disaggregated fleet (`hand_off`), a sequence with more tokens to come
  ends at its first token with FINISHED_LENGTH "handoff": it keeps its blocks and moves to a decode
  replica (policies/disagg/). Stop conditions and real length limits still win.

A sequence that just got its token holds `computed` tokens of KV: its token count - 1.
"""
from __future__ import annotations

from dataclasses import dataclass

from policies.sequence import Sequence, SequenceStatus

STOPPED = (SequenceStatus.FINISHED_STOPPED, "stop")
LENGTH = (SequenceStatus.FINISHED_LENGTH, "length")
HANDOFF_REASON = "handoff"
HANDOFF = (SequenceStatus.FINISHED_LENGTH, HANDOFF_REASON)


@dataclass(slots=True)
class StopRule:
    stop_len: int  # the sequence ends for length once it has computed this many tokens
    min_len: int  # a stop condition counts once it has computed this many
    stops: frozenset[int] | None  # stop token ids (eos included unless ignored)
    token_times: list[float] | None  # sample 0's token times (the recorder's list), else None
    hands_off: bool = False  # stop_len is the prompt's end: reaching it hands the sequence off

    @classmethod
    def of(cls, seq: Sequence, max_model_len: int, token_times: list[float] | None,
           hand_off: bool = False) -> StopRule:
        """`hand_off`: the sequence runs on a prefill replica (module docstring)."""
        request, params = seq.request, seq.request.sampling_params
        # Outputs reach max_tokens, or num_tokens reaches max_model_len.
        stop_len = min(seq.num_prompt_tokens + params.max_tokens, max_model_len) - 1
        hands_off = hand_off and stop_len > seq.num_prompt_tokens  # tokens are left for a decode replica
        if hands_off:
            stop_len = seq.num_prompt_tokens
        stops = set(params.stop_token_ids)
        if not params.ignore_eos and request.eos_token_id is not None:
            stops.add(request.eos_token_id)
        return cls(stop_len, seq.num_prompt_tokens + params.min_tokens - 1, frozenset(stops) or None, token_times,
                   hands_off)

    def ending(self, token: int, stopped: bool, computed: int) -> tuple[SequenceStatus, str] | None:
        """(status, finish reason) if sampling `token` with `computed` tokens of KV ends the sequence.
        `stopped`: the backend's stop (a stop string, a forced output length)."""
        if (stopped or (self.stops is not None and token in self.stops)) and computed >= self.min_len:
            return STOPPED
        if computed >= self.stop_len:
            return HANDOFF if self.hands_off else LENGTH
        return None

    def decode_steps_before_end(self, computed: int, token: int) -> int:
        """How many decode steps sampling `token` each leave the sequence running, from `computed`
        tokens of KV (may be <= 0): step s leaves computed + s + 1, which ends it once it reaches
        stop_len (or min_len, when `token` is a stop token)."""
        end = self.min_len if self.stops is not None and token in self.stops and self.min_len < self.stop_len \
            else self.stop_len
        return end - computed - 1
