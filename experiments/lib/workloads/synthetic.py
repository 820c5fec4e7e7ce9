"""Synthetic workloads: arrivals x length distributions x priority classes (numpy, seeded).

Arrivals (`arrival`): `offline` (everything at t = 0), `poisson` (exponential gaps at `rate`
requests/s), `gamma` (gaps ~ Gamma(shape=burstiness, scale=1 / (rate * burstiness)), vLLM's
`--burstiness`: 1 is Poisson, < 1 burstier, > 1 more regular). `burstiness` shapes gamma arrivals
only: with the others it must be 1 or null (a value they would ignore is refused, pointing at
`arrival: gamma`). The first request arrives at 0.
Lengths (`prompt_len`, `output_len`): `{dist: fixed, value}`, `{dist: uniform, low, high}`
(inclusive), `{dist: lognormal, mean, sigma, min, max}` where `mean` is the mean of the unclipped
distribution and `sigma` the std of log(length); the result is rounded and clipped to [min, max].
Priority classes: `priority: {values: [...], weights: [...]}` (each request draws one class).
`shared_prefix_len`: the first tokens of every prompt are the same (a system prompt), so the
prefix-caching block manager has something to share; a prompt shorter than the prefix is its first
tokens (so lognormal lengths with a low `min` can go with a longer prefix), and a prefix longer than
any prompt `prompt_len` can give is an error. `system_prompts: {num, len, zipf}`: each
prompt is preceded by one of `num` shared system prompts of `len` tokens, drawn Zipf-skewed
(prefixes.py); prompt lengths then count the system prompt too.
`length_correlation`: the correlation of log prompt length and log output length (both lognormal),
so that a prompt's length says something about its output's (what a length predictor learns from).
Tenants: `tenants: {names: [a, b], rates: [ra, rb], num_requests: [na, nb]}` makes each tenant its
own stream (arrivals at its own rate, lengths and prompts from its own seed derived from the run's
seed and its name) merged by arrival time; request ids are `<tenant>-<k>`. Without
`num_requests`, `num_requests` is split in proportion to the rates. A tenant's stream does not
depend on the other tenants, so a run of one tenant alone (its solo run) replays its requests of
the shared run exactly.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from experiments.lib.workloads.base import WORKLOADS, Workload, WorkloadConfig
from experiments.lib.workloads.common import (
    COUNT,
    LENGTH,
    MAX_REQUESTS,
    PromptMemory,
    get_int,
    get_positive,
    is_int,
    is_num,
    make_request,
)
from experiments.lib.workloads.prefixes import SystemPrompts, SystemPromptsSpec

ARRIVALS = ("offline", "poisson", "gamma")
DISTS = ("fixed", "uniform", "lognormal")


@dataclass(kw_only=True)
class LengthDist:
    dist: str | None = None  # fixed | uniform | lognormal
    value: int | None = None  # fixed
    low: int | None = None  # uniform
    high: int | None = None
    mean: float | None = None  # lognormal
    sigma: float | None = None
    min: int | None = None
    max: int | None = None


@dataclass(kw_only=True)
class PriorityClasses:
    values: list[int] = field(default_factory=list)
    weights: list[float] | None = None


@dataclass(kw_only=True)
class Tenants:
    names: list[str] = field(default_factory=list)
    rates: list[float] | None = None
    num_requests: list[int] | None = None


@dataclass(kw_only=True)
class SyntheticWorkloadConfig(WorkloadConfig):
    arrival: str | None = None
    burstiness: float | None = None
    prompt_len: LengthDist | None = None
    output_len: LengthDist | None = None
    max_tokens: int | None = None
    priority: PriorityClasses | None = None
    shared_prefix_len: int | None = None
    vocab_size: int | None = None
    length_correlation: float | None = None
    tenants: Tenants | None = None
    system_prompts: SystemPromptsSpec | None = None


def arrival_times(cfg: Mapping[str, Any], n: int, rng: np.random.Generator, where: str) -> np.ndarray:
    kind = cfg.get("arrival", "poisson")
    if kind not in ARRIVALS:
        raise ValueError(f"{where}.arrival={kind!r} is unknown: choose one of {list(ARRIVALS)}")
    burstiness = cfg.get("burstiness")
    if kind != "gamma" and burstiness is not None and (not is_num(burstiness) or burstiness != 1):
        raise ValueError(f"{where}.burstiness={burstiness!r} is invalid with {where}.arrival={kind}: it shapes "
                         f"gamma arrivals only (1: Poisson); set {where}.arrival=gamma for burstier or more "
                         f"regular arrivals (workload=gamma is a preset), or leave burstiness at 1")
    if kind == "offline":
        return np.zeros(n)
    rate = get_positive(cfg, "rate", where)
    shape = get_positive(cfg, "burstiness", where) if kind == "gamma" else 1.0
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def lengths(spec: Any, n: int, rng: np.random.Generator, where: str, bound: tuple[int, str] = LENGTH) -> np.ndarray:
    """n values of a length spec (tokens; sessions' turns use it too, with bound=COUNT)."""
    if not isinstance(spec, Mapping) or spec.get("dist") not in DISTS:
        got = spec.get("dist") if isinstance(spec, Mapping) else spec
        raise ValueError(f"{where}.dist={got!r} is invalid: choose one of {list(DISTS)}")
    dist = spec["dist"]
    if dist == "fixed":
        return np.full(n, get_int(spec, "value", where, 1, bound))
    if dist == "uniform":
        low, high = get_int(spec, "low", where, 1, bound), get_int(spec, "high", where, 1, bound)
        if high < low:
            raise ValueError(f"{where}.high={high} is invalid: must be >= low={low}")
        return rng.integers(low, high, size=n, endpoint=True)
    mu, sigma, low, high = _lognormal(spec, where, bound)
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), low, high).astype(np.int64)


def _lognormal(spec: Mapping[str, Any], where: str, bound: tuple[int, str] = LENGTH) -> tuple[float, float, int, int]:
    """(mu, sigma, min, max) of a lognormal length spec, checked: mu puts the unclipped mean at `mean`."""
    mean, sigma = get_positive(spec, "mean", where), spec.get("sigma")
    if not is_num(sigma) or sigma < 0:
        raise ValueError(f"{where}.sigma={sigma!r} is invalid: must be a number >= 0")
    low, high = get_int(spec, "min", where, 1, bound), get_int(spec, "max", where, 1, bound)
    if high < low:
        raise ValueError(f"{where}.max={high} is invalid: must be >= min={low}")
    return math.log(mean) - sigma * sigma / 2, sigma, low, high


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


def correlated_lengths(cfg: Mapping[str, Any], n: int, rng: np.random.Generator, where: str
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths; with `length_correlation` rho, both lognormal and their logs
    correlated by rho (a Gaussian copula on the two draws)."""
    rho = cfg.get("length_correlation")
    if not rho:
        return (lengths(cfg.get("prompt_len"), n, rng, f"{where}.prompt_len"),
                lengths(cfg.get("output_len"), n, rng, f"{where}.output_len"))
    if not is_num(rho) or not -1 <= rho <= 1:
        raise ValueError(f"{where}.length_correlation={rho!r} is invalid: must be a number in [-1, 1]")
    for key in ("prompt_len", "output_len"):
        spec = cfg.get(key)
        if not isinstance(spec, Mapping) or spec.get("dist") != "lognormal":
            raise ValueError(f"{where}.{key}.dist={spec.get('dist') if isinstance(spec, Mapping) else spec!r} "
                             "is invalid: length_correlation needs lognormal prompt and output lengths")
    z = rng.standard_normal((2, n))
    z[1] = rho * z[0] + math.sqrt(1 - rho * rho) * z[1]
    out = []
    for key, zk in (("prompt_len", z[0]), ("output_len", z[1])):
        mu, sigma, low, high = _lognormal(cfg[key], f"{where}.{key}")
        out.append(np.clip(np.rint(np.exp(mu + sigma * zk)), low, high).astype(np.int64))
    return out[0], out[1]


def tenant_streams(spec: Any, n: int, where: str) -> list[tuple[str, float, int]]:
    """(name, rate, num_requests) per tenant of a `tenants` spec."""
    names = spec.get("names") if isinstance(spec, Mapping) else None
    if not names or not all(isinstance(t, str) and t for t in names) or len(set(names)) != len(names):
        raise ValueError(f"{where}.names={names!r} is invalid: must be a list of distinct non-empty strings")
    rates = spec.get("rates")
    if not isinstance(rates, list) or len(rates) != len(names) or not all(
            is_num(r) and 0 < r < float("inf") for r in rates):
        raise ValueError(f"{where}.rates={rates!r} is invalid: need {len(names)} finite numbers > 0 "
                         "(requests/s per tenant)")
    counts = spec.get("num_requests")
    if counts is None:
        total = sum(rates)
        counts = [max(1, round(n * r / total)) for r in rates]
    elif not isinstance(counts, list) or len(counts) != len(names) or not all(is_int(c) and c >= 1 for c in counts) \
            or sum(counts) > MAX_REQUESTS:
        raise ValueError(f"{where}.num_requests={counts!r} is invalid: need {len(names)} integers >= 1 with a "
                         f"sum of at most {MAX_REQUESTS:,} (the most requests a workload may hold)")
    return [(name, float(r), int(c)) for name, r, c in zip(names, rates, counts)]


def _shared_prefix_len(cfg: Mapping[str, Any], where: str) -> int:
    """`shared_prefix_len` (0: none): at most the longest prompt `prompt_len` can give (its spec is
    checked already), since a prompt shorter than the prefix is the prefix's first tokens."""
    v = get_int(cfg, "shared_prefix_len", where, 0, LENGTH) if cfg.get("shared_prefix_len") else 0
    spec = cfg["prompt_len"]
    longest = spec[{"fixed": "value", "uniform": "high", "lognormal": "max"}[spec["dist"]]]
    if v > longest:
        raise ValueError(f"{where}.shared_prefix_len={v} is invalid: longer than any prompt {where}.prompt_len "
                         f"can give: must be at most {longest}")
    return v


def draw(cfg: Mapping[str, Any], n: int, rng: np.random.Generator, vocab_size: int, where: str,
         memory: PromptMemory) -> tuple[list[float], list[list[int]], list[int], list[int]]:
    """n requests' arrival times, prompts, output lengths (capped by max_tokens) and priorities; their
    prompts are counted in the workload's `memory` (with those of streams drawn before) before any
    token id is drawn: every id drawn counts, as all are held at once while the prompts are made."""
    arrivals = arrival_times(cfg, n, rng, where)
    prompt_lens, output_lens = correlated_lengths(cfg, n, rng, where)
    prios = priorities(cfg.get("priority"), n, rng, f"{where}.priority")
    if cfg.get("max_tokens") is not None:
        output_lens = np.minimum(output_lens, get_int(cfg, "max_tokens", where, 1, LENGTH))
    high = min(get_int(cfg, "vocab_size", where), vocab_size)
    num_system, system_len = SystemPrompts.size(cfg.get("system_prompts"), f"{where}.system_prompts")
    prefix_len = _shared_prefix_len(cfg, where)
    own = int(prompt_lens.sum())
    memory.add(own + n * system_len, own + prefix_len + num_system * system_len, f"{where}.prompt_len",
               f"lower {where}.num_requests or the prompt lengths")
    tokens = rng.integers(0, high, size=own).tolist()
    prefix = rng.integers(0, high, size=prefix_len).tolist()
    prompts, start = [], 0
    for p in prompt_lens.tolist():
        prompt = tokens[start:start + p]
        start += p
        if prefix_len:
            k = min(prefix_len, p)
            prompt[:k] = prefix[:k]
        prompts.append(prompt)
    system = SystemPrompts.from_spec(cfg.get("system_prompts"), rng, high, f"{where}.system_prompts")
    if system is not None:
        prompts = [system.prompts[k] + prompt for k, prompt in zip(system.draw(n, rng), prompts)]
    return arrivals.tolist(), prompts, output_lens.tolist(), prios.tolist()


@WORKLOADS.register("synthetic", config=SyntheticWorkloadConfig)
def build(cfg: Mapping[str, Any], seed: int, vocab_size: int, where: str = "workload") -> Workload:
    n = get_int(cfg, "num_requests", where, 1, COUNT)
    max_tokens = get_int(cfg, "max_tokens", where, 1, LENGTH) if cfg.get("max_tokens") is not None else None
    name = str(cfg.get("name", "synthetic"))
    if cfg.get("tenants") is None:
        arrivals, prompts, outs, prios = draw(cfg, n, np.random.default_rng(seed), vocab_size, where, PromptMemory())
        requests = [make_request(str(i), prompt, o, max_tokens, t, pr)
                    for i, (t, prompt, o, pr) in enumerate(zip(arrivals, prompts, outs, prios))]
        return Workload(name, requests, outs)
    items, memory = [], PromptMemory()
    for index, (tenant, rate, count) in enumerate(tenant_streams(cfg["tenants"], n, f"{where}.tenants")):
        rng = np.random.default_rng([seed, zlib.crc32(tenant.encode())])
        arrivals, prompts, outs, prios = draw({**cfg, "rate": rate}, count, rng, vocab_size, where, memory)
        items += [(t, index, k, make_request(f"{tenant}-{k}", prompt, o, max_tokens, t, pr, tenant=tenant), o)
                  for k, (t, prompt, o, pr) in enumerate(zip(arrivals, prompts, outs, prios))]
    items.sort(key=lambda it: it[:3])
    return Workload(name, [it[3] for it in items], [it[4] for it in items])
