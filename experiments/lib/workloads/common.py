"""Small helpers the workload builders share: config checks and request construction."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.request import Request, SamplingParams

SIM_TEMPERATURE = 1.0


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def get_int(cfg: Mapping[str, Any], key: str, where: str, low: int = 1) -> int:
    v = cfg.get(key)
    if not is_int(v) or v < low:
        raise ValueError(f"{where}.{key}={v!r} is invalid: must be an integer >= {low}")
    return v


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
