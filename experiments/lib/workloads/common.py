"""Small helpers the workload builders share: config checks, the bounds on what a workload may ask
for, and request construction."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.request import Request, SamplingParams, is_int

SIM_TEMPERATURE = 1.0

# What one workload may hold, checked before any token id is drawn (numpy would otherwise try to
# allocate an absurd length whole, and a merely large one fills memory before anything fails):
MAX_LENGTH = 10_000_000  # tokens of any one prompt or output: as long as the longest context windows
MAX_REQUESTS = 10_000_000  # requests
# ... and the memory its prompts' token ids take (PromptMemory). They are Python lists: a prompt
# token is an 8-byte pointer, and each id drawn (or read from a trace) afresh an int object of 32
# bytes (28, rounded up by the allocator). Prompts that reuse ids point at the same objects
# (Mooncake's shared blocks, a shared prefix or system prompt, a session's earlier turns) and take
# less, so the bound is on bytes, not tokens: 16 GiB is ~430M prompt tokens of fresh ids, and holds
# a two-hour Mooncake-style trace (358M tokens, half its blocks repeated: ~8 GiB). Transient copies
# while the prompts are made come on top.
POINTER_BYTES = 8
INT_BYTES = 32
MAX_PROMPT_BYTES = 16 * 2**30
LENGTH = (MAX_LENGTH, " (tokens; a longer prompt or output fits no model's context)")  # the `bound` of a length
COUNT = (MAX_REQUESTS, " (the most a workload may hold)")  # the `bound` of a count of requests or prompts


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_error(v: Any, low: int, bound: tuple[int, str] | None) -> str | None:
    """What is wrong with `v` as an integer >= low (and at most bound's maximum), or None."""
    if not is_int(v) or v < low:
        return f"must be an integer >= {low}"
    if bound is not None and v > bound[0]:
        return f"must be at most {bound[0]:,}{bound[1]}"
    return None


def get_int(cfg: Mapping[str, Any], key: str, where: str, low: int = 1,
            bound: tuple[int, str] | None = None) -> int:
    """An integer >= low; with `bound` (LENGTH or COUNT), at most its maximum too."""
    v = cfg.get(key)
    error = int_error(v, low, bound)
    if error:
        raise ValueError(f"{where}.{key}={v!r} is invalid: {error}")
    return v


def size_text(n: int) -> str:
    """A byte count for people: GiB, MiB or bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:,} bytes"


@dataclass(slots=True)
class PromptMemory:
    """What a workload's prompts will hold, counted before their token ids are drawn: `tokens`, the
    prompt tokens (a pointer each), and `drawn`, the ids drawn or read afresh (an int object each;
    a token that reuses one is its pointer only)."""

    tokens: int = 0
    drawn: int = 0

    @property
    def size(self) -> int:
        """The estimated bytes of the prompts' token ids."""
        return self.tokens * POINTER_BYTES + self.drawn * INT_BYTES

    def add(self, tokens: int, drawn: int, where: str, fix: str) -> None:
        """Counts the next prompts' tokens and fresh ids, if the estimate stays within
        MAX_PROMPT_BYTES; a ValueError naming `where`, the estimate, the bound and `fix` otherwise."""
        self.tokens += tokens
        self.drawn += drawn
        if self.size > MAX_PROMPT_BYTES:
            raise ValueError(f"{where}: the prompts would hold about {size_text(self.size)} of token ids "
                             f"({self.tokens:,} prompt tokens at {POINTER_BYTES} bytes and {self.drawn:,} token ids "
                             f"drawn afresh at {INT_BYTES}), more than the {size_text(MAX_PROMPT_BYTES)} a workload "
                             f"may hold: {fix}")


def get_positive(cfg: Mapping[str, Any], key: str, where: str) -> float:
    v = cfg.get(key)
    if not is_num(v) or not 0 < v < float("inf"):
        raise ValueError(f"{where}.{key}={v!r} is invalid: must be a finite number > 0")
    return float(v)


def make_request(request_id: str, prompt: list[int], output_len: int, max_tokens: int | None,
                 arrival: float, priority: int, temperature: float = SIM_TEMPERATURE,
                 tenant: str | None = None) -> Request:
    """A request that runs to output_len: max_tokens = output_len, or a larger cap (then the
    backend stops it at output_len); ignore_eos so a real model cannot end it earlier."""
    cap = output_len if max_tokens is None else max(max_tokens, output_len)
    params = SamplingParams(temperature=temperature, max_tokens=cap, ignore_eos=True)
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                   arrival_time=arrival, priority=priority, tenant=tenant)
