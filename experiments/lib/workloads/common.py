"""Small helpers the workload builders share: config checks, the bounds on what a workload may ask
for, and request construction."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.request import Request, SamplingParams

SIM_TEMPERATURE = 1.0

# What one workload may hold, checked before any token id is drawn (numpy would otherwise try to
# allocate an absurd length whole, and a merely large one fills memory before anything fails):
MAX_LENGTH = 10_000_000  # tokens of any one prompt or output: as long as the longest context windows
MAX_REQUESTS = 10_000_000  # requests
MAX_PROMPT_TOKENS = 250_000_000  # prompt tokens of all its requests together: ~10 GB of token ids
LENGTH = (MAX_LENGTH, " (tokens; a longer prompt or output fits no model's context)")  # the `bound` of a length
COUNT = (MAX_REQUESTS, " (the most a workload may hold)")  # the `bound` of a count of requests or prompts


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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


def check_prompt_tokens(total: int, where: str, fix: str) -> int:
    """`total`, the prompt tokens of a workload's requests so far with the next ones, if at most
    MAX_PROMPT_TOKENS (checked before those are drawn); a ValueError naming `where` and `fix` otherwise."""
    if total > MAX_PROMPT_TOKENS:
        raise ValueError(f"{where}: {total:,} prompt tokens in all, more than the {MAX_PROMPT_TOKENS:,} a workload "
                         f"may hold (about 10 GB of token ids): {fix}")
    return total


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
