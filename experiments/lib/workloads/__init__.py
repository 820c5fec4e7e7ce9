"""Workloads: the request streams runs feed to a backend (config group `workload`).

`build_workload(cfg, seed, vocab_size)` dispatches on `cfg["kind"]`:
`synthetic` (offline / Poisson / Gamma arrivals x fixed / uniform / lognormal lengths, priority
classes, shared prefix, shared system prompts), `sessions` (multi-turn conversations), `nanovllm`
(nano-vllm's bench.py draw), `replay` (a CSV/JSONL trace) and the public trace formats `azure`,
`burstgpt` and `mooncake` (docs/fleet.md).
Every request carries `max_tokens` and `ignore_eos=True`; its natural output length is
`output_lens[i]` (== max_tokens unless the workload sets a larger `max_tokens` cap, in which case
the backend ends it at output_len: the simulator emits a stop token there).
`rate` is null or a finite number > 0 whatever the kind; the synthetic kinds whose arrivals do not
come at a rate (offline arrivals, tenants' own rates, nanovllm) leave a valid one unused, so that
one sweep over `workload.rate` can take in such workloads too. The traces (replay, azure, burstgpt,
mooncake) replay their own arrival times and refuse a rate: `time_scale` scales them.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from experiments.lib.workloads import (  # noqa: F401  (registration)
    azure,
    burstgpt,
    mooncake,
    nanovllm,
    replay,
    sessions,
    synthetic,
)
from experiments.lib.workloads.base import WORKLOADS, Workload
from experiments.lib.workloads.common import get_positive


def build_workload(cfg: Mapping[str, Any], seed: int, vocab_size: int) -> Workload:
    """cfg: the `workload` config section; seed: used unless cfg['seed'] is set."""
    build = WORKLOADS.get(cfg.get("kind", "synthetic"), where="workload")
    if cfg.get("rate") is not None:
        get_positive(cfg, "rate", "workload")
    if cfg.get("seed") is not None:
        seed = cfg["seed"]
    return build(cfg, seed, vocab_size)


__all__ = ["WORKLOADS", "Workload", "build_workload"]
