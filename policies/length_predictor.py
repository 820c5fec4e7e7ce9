"""Output-length knowledge for length-aware policies (sjf, srpt): how many tokens a request will
generate, as the scheduler may know it.

- `max_tokens`: what the client declared (`SamplingParams.max_tokens`), all a real server knows
  without a model of its traffic; in the simulator's workloads it is the true length unless the
  workload caps `max_tokens`.
- `oracle`: the true output lengths (a workload's, handed over by the experiment): the upper bound of
  what any predictor can reach, never available in production.
- `noisy-oracle`: the true length times lognormal noise of `sigma` (median-unbiased), to measure how
  a policy's gain decays with a predictor's error.
- `bucket`: a cheap learned predictor: prompt lengths are cut into power-of-two buckets, and each
  bucket predicts the mean output length its training requests had (the overall mean for an empty
  bucket). `fit` learns it from any trace of (prompt length, output length) pairs.

A predictor is built by name from the registry (`make_predictor("bucket", ...)`); the experiments
build the oracle and fit the bucket predictor (experiments/lib/predictors.py).
"""
from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from typing import Any

from policies.registry import Registry
from policies.request import Request

PREDICTORS: Registry[type[OutputLengthPredictor]] = Registry("length predictor", field="kind")
register_predictor = PREDICTORS.register


def make_predictor(kind: str, **kwargs: Any) -> OutputLengthPredictor:
    return PREDICTORS.get(kind)(**kwargs)


class OutputLengthPredictor(ABC):
    kind: str = "base"

    @abstractmethod
    def predict(self, request: Request) -> float:
        """The output tokens `request` is expected to generate (per sample), > 0. Called often
        (every key of a queued sequence): keep it a lookup."""


@register_predictor("max_tokens")
class MaxTokensPredictor(OutputLengthPredictor):
    kind = "max_tokens"

    def predict(self, request: Request) -> float:
        return float(request.sampling_params.max_tokens)


@register_predictor("oracle")
class OraclePredictor(OutputLengthPredictor):
    kind = "oracle"

    def __init__(self, lengths: Mapping[str, int]) -> None:
        """`lengths`: request id -> true output length; a request not in it falls back to max_tokens."""
        self.lengths = {str(k): float(v) for k, v in lengths.items()}

    def predict(self, request: Request) -> float:
        return self.lengths.get(request.request_id, float(request.sampling_params.max_tokens))


@register_predictor("noisy-oracle")
class NoisyOraclePredictor(OraclePredictor):
    kind = "noisy-oracle"

    def __init__(self, lengths: Mapping[str, int], sigma: float, seed: int = 0) -> None:
        """The true length times exp(sigma * z), z ~ N(0, 1) drawn per request id from `seed`."""
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0 <= sigma < math.inf:
            raise ValueError(f"sigma={sigma!r} is invalid: must be a finite number >= 0")
        super().__init__({rid: max(1.0, n * math.exp(sigma * random.Random(f"{seed}:{rid}").gauss(0.0, 1.0)))
                          for rid, n in lengths.items()})
        self.sigma = float(sigma)


@register_predictor("bucket")
class BucketPredictor(OutputLengthPredictor):
    kind = "bucket"

    def __init__(self, edges: list[int], estimates: list[float]) -> None:
        """Bucket i holds prompt lengths in [edges[i - 1], edges[i]) (edges ascending, the first
        bucket from 0, the last to infinity: len(estimates) == len(edges) + 1)."""
        if len(estimates) != len(edges) + 1 or list(edges) != sorted(edges) or not all(e > 0 for e in estimates):
            raise ValueError(f"edges={edges!r}, estimates={estimates!r} are invalid: ascending edges and "
                             "one positive estimate more than edges")
        self.edges = list(edges)
        self.estimates = [float(e) for e in estimates]

    @classmethod
    def fit(cls, pairs: Iterable[tuple[int, int]]) -> BucketPredictor:
        """Learn from (prompt length, output length) pairs: buckets at powers of two, each predicting
        its pairs' mean output length (the overall mean where a bucket has none)."""
        pairs = [(int(p), int(o)) for p, o in pairs]
        if not pairs:
            raise ValueError("a bucket predictor needs at least one (prompt length, output length) pair to fit")
        top = max(p for p, _ in pairs)
        edges = [2 ** k for k in range(1, max(1, top.bit_length()) + 1)]
        sums, counts = [0.0] * (len(edges) + 1), [0] * (len(edges) + 1)
        for p, o in pairs:
            i = bisect_right(edges, p)
            sums[i] += o
            counts[i] += 1
        overall = sum(sums) / len(pairs)
        return cls(edges, [s / c if c else overall for s, c in zip(sums, counts)])

    def predict(self, request: Request) -> float:
        return self.estimates[bisect_right(self.edges, request.num_prompt_tokens)]
