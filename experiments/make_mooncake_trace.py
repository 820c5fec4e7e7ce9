"""`python -m experiments.make_mooncake_trace --hours 1 --out FILE [--seed S]`: a seeded synthetic
trace in the Mooncake JSONL layout (`workload=mooncake workload.path=FILE`, docs/fleet.md), for when
the public trace cannot be downloaded.

Each line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`, hash ids
naming the prompt's blocks of 512 tokens (the last one partly filled), equal ids equal blocks. The
defaults follow what the Mooncake technical report (Qin et al., "Mooncake: A KVCache-centric
Disaggregated Architecture for LLM Serving", arXiv 2407.00079, and FAST'25) reports of its public
one-hour trace (github.com/kvcache-ai/Mooncake, `mooncake_trace.jsonl`): 23,608 requests in an hour,
mean input 7,590 tokens, mean output 182 tokens, and heavy prefix sharing: the trace holds about
183k distinct block ids among ~360k block references, so about half of all prompt blocks repeat a
block seen earlier (what an unbounded prefix cache would serve).

How it is drawn (numpy, seeded): arrivals are a Poisson stream at `rate` requests/s; input and output
lengths are lognormal with the given means and log-space spread `sigma`, clipped to
[1, max_input] and [1, max_output]. With probability `share` a request continues one of the last
`window` requests (uniformly drawn; multi-turn chats and agents resending their context): its
leading hash ids are that request's, up to all but its own last block, followed by new ids;
otherwise all its ids are new. New ids count up from 0, as in the public trace. What is not
modelled: the trace's burstiness and the correlation between a continuation's length and its
parent's (lengths are drawn independently of the parent). The command prints the statistics of
what it wrote (requests, duration, mean lengths, fraction of repeated blocks).
"""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.lib.workloads.common import MAX_REQUESTS  # the trace is built in memory
from policies.request import is_int

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class MooncakeTraceSpec:
    hours: float = 1.0
    rate: float = 23608 / 3600  # requests/s of the public trace
    mean_input: float = 7590.0
    mean_output: float = 182.0
    sigma: float = 0.8  # lognormal spread (log space) of both lengths
    max_input: int = 129024  # Llama-3.1's 131072 positions less max_output
    max_output: int = 2048
    share: float = 0.9  # fraction of requests continuing an earlier one
    window: int = 1000  # how many recent requests a continuation picks from
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("hours", "rate", "mean_input", "mean_output", "sigma"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{key}={v!r} is invalid: must be a number > 0")
        for key in ("max_input", "max_output", "window"):
            v = getattr(self, key)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{key}={v!r} is invalid: must be an integer >= 1")
        for length in ("input", "output"):  # a mean past its cap would be a trace of capped lengths
            mean, cap = getattr(self, f"mean_{length}"), getattr(self, f"max_{length}")
            if mean > cap:
                raise ValueError(f"mean_{length}={mean!r} is invalid: above max_{length}={cap} (lengths are "
                                 f"capped there): lower mean_{length} or raise max_{length}")
        if not (isinstance(self.share, (int, float)) and 0 <= self.share <= 1):
            raise ValueError(f"share={self.share!r} is invalid: must be a number in [0, 1]")
        if not is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} is invalid: must be an integer >= 0")
        if self.rate * self.hours * 3600 > MAX_REQUESTS:
            raise ValueError(f"rate={self.rate!r} with hours={self.hours!r} is invalid: about "
                             f"{self.rate * self.hours * 3600:.3g} requests, more than {MAX_REQUESTS:,} (the trace "
                             "is built in memory): lower hours or rate")


def lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, cap: int, n: int) -> np.ndarray:
    """n integer lengths in [1, cap], lognormal with the given mean before rounding and clipping."""
    return np.clip(np.rint(rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, n)), 1, cap).astype(int)


def make_trace(spec: MooncakeTraceSpec) -> list[dict]:
    """The trace's rows in arrival order (deterministic given the spec)."""
    rng = np.random.default_rng(spec.seed)
    duration_s = spec.hours * 3600.0
    gaps = rng.exponential(1.0 / spec.rate, int(spec.rate * duration_s * 1.2) + 100)
    times = np.cumsum(gaps) - gaps[0]
    times = times[times < duration_s]
    n = len(times)
    inputs = lognormal_lengths(rng, spec.mean_input, spec.sigma, spec.max_input, n)
    outputs = lognormal_lengths(rng, spec.mean_output, spec.sigma, spec.max_output, n)
    continues = rng.random(n) < spec.share
    picks = rng.random(n)
    rows: list[dict] = []
    next_id = 0
    for k in range(n):
        num_blocks = -(-int(inputs[k]) // BLOCK_TOKENS)
        ids: list[int] = []
        if continues[k] and k > 0:
            first = max(0, k - spec.window)
            parent = rows[first + int(picks[k] * (k - first))]["hash_ids"]
            ids = parent[:min(len(parent), num_blocks - 1)]
        fresh = num_blocks - len(ids)
        ids = ids + list(range(next_id, next_id + fresh))
        next_id += fresh
        rows.append({"timestamp": int(times[k] * 1000), "input_length": int(inputs[k]),
                     "output_length": int(outputs[k]), "hash_ids": ids})
    return rows


def trace_stats(rows: Sequence[dict]) -> dict[str, float]:
    """Requests, duration (s), mean lengths and the fraction of block references repeating an earlier block."""
    seen: set[int] = set()
    refs = repeats = 0
    for row in rows:
        for h in row["hash_ids"]:
            refs += 1
            repeats += h in seen
            seen.add(h)
    return {"requests": len(rows), "duration_s": rows[-1]["timestamp"] / 1000.0 if rows else 0.0,
            "mean_input": float(np.mean([r["input_length"] for r in rows])),
            "mean_output": float(np.mean([r["output_length"] for r in rows])),
            "distinct_blocks": len(seen), "repeated_block_fraction": repeats / refs if refs else 0.0}


def main(argv: Sequence[str] | None = None) -> None:
    defaults = MooncakeTraceSpec()
    parser = argparse.ArgumentParser(prog="python -m experiments.make_mooncake_trace",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the .jsonl file to write")
    for key, kind in (("hours", float), ("rate", float), ("mean_input", float), ("mean_output", float),
                      ("sigma", float), ("max_input", int), ("max_output", int), ("share", float),
                      ("window", int), ("seed", int)):
        parser.add_argument("--" + key.replace("_", "-"), type=kind, default=getattr(defaults, key))
    args = parser.parse_args(argv)
    if args.out.suffix != ".jsonl":
        parser.error(f"--out={str(args.out)!r} is invalid: a Mooncake trace is a .jsonl file")
    try:
        spec = MooncakeTraceSpec(**{k: v for k, v in vars(args).items() if k != "out"})
    except ValueError as exc:
        parser.error(f"--{str(exc).replace('_', '-')}")
    rows = make_trace(spec)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    except OSError as exc:
        parser.error(f"--out={str(args.out)!r} is invalid: cannot write it ({exc.strerror})")
    stats = trace_stats(rows)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in stats.items()))


if __name__ == "__main__":
    main()
