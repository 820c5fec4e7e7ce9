"""Workloads: the request streams runs feed to a backend (config group `workload`).

`build_workload(cfg, seed, vocab_size)` dispatches on `cfg["kind"]`:
`synthetic` (offline / Poisson / Gamma arrivals x fixed / uniform / lognormal lengths, priority
classes, shared prefix, shared system prompts), `sessions` (multi-turn conversations), `nanovllm`
(nano-vllm's bench.py draw), `replay` (a CSV/JSONL trace) and the public trace formats `azure`,
`burstgpt` and `mooncake` (docs/fleet.md).
Every request carries `max_tokens` and `ignore_eos=True`; its natural output length is
`output_lens[i]` (== max_tokens unless the workload sets a larger `max_tokens` cap, in which case
the backend ends it at output_len: the simulator emits a stop token there).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from policies.request import Request


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[Request]  # sorted by arrival time
    output_lens: list[int]

    def __post_init__(self) -> None:
        if len(self.requests) != len(self.output_lens):
            raise ValueError("Workload needs one output length per request")
        for request in self.requests:  # once here, not again as each run adds them to a scheduler
            request.validate(None)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def stop_lens(self) -> dict[str, int]:
        """Requests that must end before max_tokens: request_id -> output length."""
        return {r.request_id: n for r, n in zip(self.requests, self.output_lens)
                if n < r.sampling_params.max_tokens}

    def fresh(self) -> Workload:
        """An identical stream of new Request objects (runs mutate requests as they finish)."""
        reqs = [r.fresh_copy() for r in self.requests]
        return Workload(self.name, reqs, list(self.output_lens))

    def rows(self) -> list[dict[str, Any]]:
        return [{"request_id": r.request_id, "arrival_time": r.arrival_time,
                 "num_prompt_tokens": r.num_prompt_tokens, "output_len": n,
                 "max_tokens": r.sampling_params.max_tokens, "priority": r.priority, "tenant": r.tenant}
                for r, n in zip(self.requests, self.output_lens)]


Builder = Callable[[Mapping[str, Any], int, int], Workload]
_BUILDERS: dict[str, Builder] = {}


def register_workload(kind: str) -> Callable[[Builder], Builder]:
    def wrap(fn: Builder) -> Builder:
        _BUILDERS[kind] = fn
        return fn
    return wrap


def build_workload(cfg: Mapping[str, Any], seed: int, vocab_size: int) -> Workload:
    """cfg: the `workload` config section; seed: used unless cfg['seed'] is set."""
    kind = cfg.get("kind", "synthetic")
    if kind not in _BUILDERS:
        raise ValueError(f"workload.kind={kind!r} is unknown: choose one of {sorted(_BUILDERS)}")
    if cfg.get("seed") is not None:
        seed = cfg["seed"]
    return _BUILDERS[kind](cfg, seed, vocab_size)


from experiments.lib.workloads import (  # noqa: E402, F401  (registration)
    azure,
    burstgpt,
    mooncake,
    nanovllm,
    replay,
    sessions,
    synthetic,
)

__all__ = ["Workload", "build_workload", "register_workload"]
