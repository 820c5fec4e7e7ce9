"""Synthetic workloads: arrivals x length distributions x priority classes (numpy, seeded).

Arrivals (`arrival`): `offline` (everything at t = 0), `poisson` (exponential gaps at `rate`
requests/s), `gamma` (gaps ~ Gamma(shape=burstiness, scale=1 / (rate * burstiness)), vLLM's
`--burstiness`: 1 is Poisson, < 1 burstier, > 1 more regular). The first request arrives at 0.
Lengths (`prompt_len`, `output_len`): `{dist: fixed, value}`, `{dist: uniform, low, high}`
(inclusive), `{dist: lognormal, mean, sigma, min, max}` where `mean` is the mean of the unclipped
distribution and `sigma` the std of log(length); the result is rounded and clipped to [min, max].
Priority classes: `priority: {values: [...], weights: [...]}` (each request draws one class).
`shared_prefix_len`: the first tokens of every prompt are the same (a system prompt), so the
prefix-caching block manager has something to share.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from experiments.lib.workloads import Workload, register_workload
from experiments.lib.workloads.common import get_int, get_positive, is_int, is_num, make_request

ARRIVALS = ("offline", "poisson", "gamma")
DISTS = ("fixed", "uniform", "lognormal")


def arrival_times(cfg: Mapping[str, Any], n: int, rng: np.random.Generator, where: str) -> np.ndarray:
    kind = cfg.get("arrival", "poisson")
    if kind not in ARRIVALS:
        raise ValueError(f"{where}.arrival={kind!r} is unknown: choose one of {list(ARRIVALS)}")
    if kind == "offline":
        return np.zeros(n)
    rate = get_positive(cfg, "rate", where)
    shape = get_positive(cfg, "burstiness", where) if kind == "gamma" else 1.0
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def lengths(spec: Any, n: int, rng: np.random.Generator, where: str) -> np.ndarray:
    if not isinstance(spec, Mapping) or spec.get("dist") not in DISTS:
        got = spec.get("dist") if isinstance(spec, Mapping) else spec
        raise ValueError(f"{where}.dist={got!r} is invalid: choose one of {list(DISTS)}")
    dist = spec["dist"]
    if dist == "fixed":
        return np.full(n, get_int(spec, "value", where))
    if dist == "uniform":
        low, high = get_int(spec, "low", where), get_int(spec, "high", where)
        if high < low:
            raise ValueError(f"{where}.high={high} is invalid: must be >= low={low}")
        return rng.integers(low, high, size=n, endpoint=True)
    mean, sigma = get_positive(spec, "mean", where), spec.get("sigma")
    if not is_num(sigma) or sigma < 0:
        raise ValueError(f"{where}.sigma={sigma!r} is invalid: must be a number >= 0")
    low, high = get_int(spec, "min", where), get_int(spec, "max", where)
    if high < low:
        raise ValueError(f"{where}.max={high} is invalid: must be >= min={low}")
    mu = math.log(mean) - sigma * sigma / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), low, high).astype(np.int64)


def priorities(spec: Any, n: int, rng: np.random.Generator, where: str) -> np.ndarray:
    if spec is None:
        return np.zeros(n, dtype=np.int64)
    values, weights = spec.get("values"), spec.get("weights")
    if not values or not all(is_int(v) for v in values):
        raise ValueError(f"{where}.values={values!r} is invalid: must be a non-empty list of integers")
    if weights is None:
        weights = [1.0] * len(values)
    if len(weights) != len(values) or not all(is_num(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{where}.weights={weights!r} is invalid: need {len(values)} numbers >= 0 "
                         "with a positive sum")
    p = np.asarray(weights, dtype=float) / sum(weights)
    return np.asarray(values, dtype=np.int64)[rng.choice(len(values), size=n, p=p)]


@register_workload("synthetic")
def build(cfg: Mapping[str, Any], seed: int, vocab_size: int, where: str = "workload") -> Workload:
    n = get_int(cfg, "num_requests", where)
    rng = np.random.default_rng(seed)
    arrivals = arrival_times(cfg, n, rng, where)
    prompt_lens = lengths(cfg.get("prompt_len"), n, rng, f"{where}.prompt_len")
    output_lens = lengths(cfg.get("output_len"), n, rng, f"{where}.output_len")
    prios = priorities(cfg.get("priority"), n, rng, f"{where}.priority")
    max_tokens = cfg.get("max_tokens")
    if max_tokens is not None:
        max_tokens = get_int(cfg, "max_tokens", where)
        output_lens = np.minimum(output_lens, max_tokens)
    high = min(get_int(cfg, "vocab_size", where), vocab_size)
    tokens = rng.integers(0, high, size=int(prompt_lens.sum())).tolist()
    prefix_len = get_int(cfg, "shared_prefix_len", where, low=0) if cfg.get("shared_prefix_len") else 0
    prefix = rng.integers(0, high, size=prefix_len).tolist()
    requests, start = [], 0
    for i, (t, p, o, pr) in enumerate(zip(arrivals.tolist(), prompt_lens.tolist(),
                                          output_lens.tolist(), prios.tolist())):
        prompt = tokens[start:start + p]
        start += p
        if prefix_len:
            k = min(prefix_len, p)
            prompt[:k] = prefix[:k]
        requests.append(make_request(str(i), prompt, o, max_tokens, t, pr))
    return Workload(str(cfg.get("name", "synthetic")), requests, output_lens.tolist())
