"""What a user asks for: a `Request` with its `SamplingParams`, validated at the door.

Both backends share these types. Validation raises `ValueError` naming the field, the
value and what is allowed, so bad input never travels into the scheduler.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS): dividing logits by a tinier one
# overflows float32 (1e-45 turns every logit into inf) and the draw returns garbage.
MIN_TEMPERATURE = 1e-5


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")


def is_int(value: object) -> bool:
    """An integer that is not a bool (a token id, a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass(slots=True)
class SamplingParams:
    """vLLM-compatible sampling and length limits. temperature 0 means greedy; so does any
    temperature below MIN_TEMPERATURE (1e-5), which is set to 0 here, as vLLM treats it."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings; need a tokenizer (engine only)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return with each sampled token
    # Penalties over the tokens generated so far (presence, frequency: OpenAI's, subtracted from the
    # logits) and over prompt + generated tokens (repetition: CTRL's, > 1 discourages), as vLLM.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the stop string / stop token's text in the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # What the engine hands back per step (vLLM's RequestOutputKind): "cumulative" (everything so far,
    # every step the request makes progress), "delta" (only what is new), "final_only" (one output
    # when the request ends; LLM.generate uses it).
    output_kind: str = "cumulative"

    @property
    def streams(self) -> bool:
        """Whether the request gets an output at every step it makes progress (not only its last)."""
        return self.output_kind != "final_only"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.temperature, (int, float)) and 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        self.validate()

    def validate(self) -> None:
        _check(is_int(self.n) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
               and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf")),
               "temperature", self.temperature, f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
               "top_p", self.top_p, "must be in (0, 1]")
        _check(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0),
               "top_k", self.top_k, "must be -1 (disabled), 0 (disabled) or a positive integer")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
               "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or is_int(self.seed), "seed", self.seed, "must be an integer or None")
        _check(is_int(self.max_tokens) and self.max_tokens >= 1,
               "max_tokens", self.max_tokens, "must be an integer >= 1")
        _check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")
        _check(all(is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be non-empty strings")
        _check(self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0),
               "logprobs", self.logprobs, "must be None or an integer >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, value, "must be a number in [-2, 2]")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty < float("inf"),
               "repetition_penalty", self.repetition_penalty, "must be a number > 0 (1 = no penalty)")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be true or false")
        _check(self.output_kind in OUTPUT_KINDS, "output_kind", self.output_kind,
               f"must be one of {', '.join(OUTPUT_KINDS)}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """The stop_token_ids within the model's vocabulary of `vocab_size` ids: one past it is never
        sampled, so it would never stop anything. One rule for the engine (`Request.validate`) and the
        simulator, which has no prompt ids to check but the model's vocabulary all the same."""
        if self.stop_token_ids:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            _check(not bad, "stop_token_ids", bad[:5], f"token ids must be integers in [0, {vocab_size}) "
                   "(the model's vocabulary)")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(slots=True)
class Request:
    """One user request. Its sequences (n of them after the prompt is done) live in the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    priority: int = 0  # lower value = more urgent
    eos_token_id: int | None = None
    # The client the request is served for (fair-share policies, per-tenant metrics); None: no tenant.
    tenant: str | None = None
    # The conversation the request continues (multi-turn workloads); a router may keep a session on
    # one replica, whose prefix cache then holds its earlier turns. None: no session.
    session_id: str | None = None
    # Filled in by the scheduler when the request ends; never None after that.
    finish_reason: str | None = None
    # What the last `validate` checked: (prompt list, its length, sampling params, vocab_size).
    _validated: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self, max_model_len: int | None, vocab_size: int | None = None) -> None:
        """ValueError naming the first bad field. `max_model_len` None: any prompt length.
        `vocab_size` (None: unknown) bounds the prompt's token ids and the stop_token_ids.
        The prompt's token ids and the sampling params (the costly part) are checked once: again
        only if the prompt list, its length, the params object or a vocab_size changes (requests
        are not meant to change in place once handed over: workloads build them validated)."""
        _check(isinstance(self.request_id, str) and self.request_id != "", "request_id",
               self.request_id, "must be a non-empty string")
        ids = self.prompt_token_ids
        n = len(ids)
        _check(n > 0, "prompt_token_ids", ids, "the prompt must hold at least one token")
        _check(max_model_len is None or n <= max_model_len, "prompt_token_ids", f"<{n} tokens>",
               f"the prompt is longer than max_model_len={max_model_len}")
        done = self._validated
        if done is not None and done[0] is ids and done[1] == n and done[2] is self.sampling_params \
                and (vocab_size is None or done[3] == vocab_size):
            self._check_scalars()
            return
        # Fast path: plain ints within range.
        if not (set(map(type, ids)) == {int} and min(ids) >= 0
                and (vocab_size is None or max(ids) < vocab_size)):
            bad = [t for t in ids if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size)]
            limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            _check(not bad, "prompt_token_ids", bad[:5], f"token ids must be integers in {limit}")
        self._check_scalars()
        params = self.sampling_params
        _check(isinstance(params, SamplingParams), "sampling_params", params, "must be a SamplingParams")
        params.validate()
        if vocab_size is not None:
            params.check_vocabulary(vocab_size)
        self._validated = (ids, n, params, vocab_size)

    def fresh_copy(self) -> Request:
        """A copy to run again: finish_reason cleared, its own SamplingParams (checked as it is
        built), the prompt list shared; validated if this one was, without scanning the prompt again."""
        params = dataclasses.replace(self.sampling_params)
        copy = dataclasses.replace(self, sampling_params=params, finish_reason=None)
        done = self._validated
        if done is not None and done[0] is self.prompt_token_ids and done[1] == len(done[0]) \
                and done[2] is self.sampling_params:
            copy._validated = (done[0], done[1], params, done[3])
        return copy

    def _check_scalars(self) -> None:
        _check(is_int(self.priority), "priority", self.priority, "must be an integer (lower = more urgent)")
        _check(self.tenant is None or (isinstance(self.tenant, str) and self.tenant != ""), "tenant",
               self.tenant, "must be None or a non-empty string")
        _check(self.session_id is None or (isinstance(self.session_id, str) and self.session_id != ""),
               "session_id", self.session_id, "must be None or a non-empty string")
        _check(isinstance(self.arrival_time, (int, float)) and self.arrival_time >= 0,
               "arrival_time", self.arrival_time, "must be a number >= 0")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
