"""Output-length predictors from a config (policies/length_predictor.py), and their error.

A length-aware policy's yaml names its predictor: `predictor: max_tokens`, `predictor: oracle`,
`predictor: {kind: noisy-oracle, sigma: 1.0}`, or `predictor: {kind: bucket, trace: <file>}`. The
bucket predictor is fitted on `trace` (a run's `requests.parquet`, or a replay `.jsonl` / `.csv`
trace); with `trace: null` on a training draw of the run's own workload config with another seed
(`seed + train_seed_offset`), i.e. yesterday's traffic of the same kind, never the requests it
predicts. The oracle and the noisy oracle read the workload's true output lengths.

The error is reported in summary.json (`output_len_predictor`, docs/metrics.md): mean absolute
error, mean relative error |predicted - true| / true, and the Spearman rank correlation of predicted
and true lengths over the run's requests (what an ordering policy needs is the ranking).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from experiments.lib.paths import resolve_path
from experiments.lib.workloads import Workload, build_workload
from policies.length_predictor import PREDICTORS, BucketPredictor, OutputLengthPredictor, make_predictor

WHERE = "policy.predictor"


def predictor_spec(spec: Any) -> dict[str, Any]:
    """`predictor: <kind>` or `{kind: <kind>, ...}` as a dict with `kind`."""
    spec = {"kind": spec} if isinstance(spec, str) else dict(spec or {})
    if spec.get("kind") not in PREDICTORS:
        raise ValueError(f"{WHERE}.kind={spec.get('kind')!r} is unknown: choose one of {PREDICTORS.names()}")
    return spec


def training_pairs(spec: Mapping[str, Any], workload_cfg: Mapping[str, Any], seed: int,
                   vocab_size: int) -> list[tuple[int, int]]:
    """(prompt length, output length) pairs to fit on: `spec['trace']`, or a training draw."""
    trace = spec.get("trace")
    if trace:
        path = resolve_path(str(trace))
        if not path.is_file():
            raise ValueError(f"{WHERE}.trace={str(trace)!r} is invalid: no such file")
        if path.suffix == ".parquet":
            df = pd.read_parquet(path, columns=["prompt_len", "output_len", "status"])
            df = df[df["status"] == "finished"]
            return list(zip(df["prompt_len"].tolist(), df["output_len"].tolist()))
        wl = build_workload({"kind": "replay", "path": str(path)}, seed, vocab_size)
    else:
        offset = spec.get("train_seed_offset", 1)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset == 0:
            raise ValueError(f"{WHERE}.train_seed_offset={offset!r} is invalid: a non-zero integer "
                             "(the training draw must not be the run's own requests)")
        wl = build_workload({**workload_cfg, "seed": None}, seed + offset, vocab_size)
    return [(r.num_prompt_tokens, n) for r, n in zip(wl.requests, wl.output_lens)]


def build_predictor(spec: Any, workload: Workload | None, workload_cfg: Mapping[str, Any] | None = None,
                    seed: int = 0, vocab_size: int = 2**31) -> OutputLengthPredictor:
    spec = predictor_spec(spec)
    kind = spec.pop("kind")
    if kind in ("oracle", "noisy-oracle"):
        if workload is None:
            raise ValueError(f"{WHERE}.kind={kind!r} needs the workload's true output lengths: "
                             "only runs of a workload (experiments.run, ab, showcase) have them")
        lengths = {r.request_id: n for r, n in zip(workload.requests, workload.output_lens)}
        return make_predictor(kind, lengths=lengths, **spec)
    if kind == "bucket":
        if workload_cfg is None and not spec.get("trace"):
            raise ValueError(f"{WHERE}.trace=None is invalid here: give a trace file to fit on")
        if workload_cfg is not None and workload_cfg.get("seed") is not None:
            seed = workload_cfg["seed"]
        return BucketPredictor.fit(training_pairs(spec, workload_cfg or {}, seed, vocab_size))
    return make_predictor(kind, **spec)


def prediction_error(predictor: OutputLengthPredictor, workload: Workload) -> dict[str, Any]:
    """The predictor's error on the workload's requests (module docstring)."""
    true = np.asarray(workload.output_lens, dtype=float)
    pred = np.asarray([predictor.predict(r) for r in workload.requests], dtype=float)
    rank = pd.Series(pred).rank().corr(pd.Series(true).rank()) if len(true) > 1 else float("nan")
    return {"kind": predictor.kind, "mae": float(np.abs(pred - true).mean()),
            "mean_relative_error": float((np.abs(pred - true) / true).mean()),
            "spearman": None if np.isnan(rank) else float(rank)}
