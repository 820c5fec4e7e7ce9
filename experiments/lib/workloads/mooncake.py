"""Mooncake traces (github.com/kvcache-ai/Mooncake, FAST'25), JSONL, one request a line:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

`timestamp` (milliseconds) -> arrival time, relative to the trace's first request; `output_length`
-> output length; `hash_ids`: the ids of the prompt's consecutive blocks of `block_tokens` tokens
(512 in the published traces). Equal ids are equal token blocks, so requests with a common run of
leading ids share that prefix (and a prefix cache can serve it): block id h holds token ids drawn
from a generator seeded by (the run's seed, h), drawn only as far as prompts read it (the ids
are the same either way). The prompt is the first `input_length` tokens of its blocks, so
`input_length` must be at most len(hash_ids) x block_tokens.
Config: `path`, `num_requests` (first N lines), `time_scale`, `block_tokens`, `drop_empty` (imported.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from experiments.lib.workloads.azure import AzureWorkloadConfig
from experiments.lib.workloads.base import WORKLOADS, Workload
from experiments.lib.workloads.common import LENGTH, PromptMemory, get_int
from experiments.lib.workloads.imported import drop_empty, lengths, workload
from experiments.lib.workloads.replay import bad_field, more_prompt_tokens, number, trace_rows
from policies.request import is_int


@dataclass(kw_only=True)
class MooncakeWorkloadConfig(AzureWorkloadConfig):
    block_tokens: int | None = None


@WORKLOADS.register("mooncake", config=MooncakeWorkloadConfig)
def build(cfg: Mapping[str, Any], seed: int, vocab_size: int, where: str = "workload") -> Workload:
    path, rows, scale = trace_rows(cfg, where, "Mooncake .jsonl")
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{where}.path={str(cfg['path'])!r} is invalid: a Mooncake trace is .jsonl")
    drop = drop_empty(cfg, where)
    size = get_int(cfg, "block_tokens", where, 1, LENGTH) if cfg.get("block_tokens") is not None else 512
    items, dropped, memory = [], 0, PromptMemory()
    drawn: dict[int, int] = {}  # block id -> how far its draw goes (the build below draws as this counts)
    for line, row in rows:
        t = number(path, line, row, "timestamp") / 1000.0
        lens = lengths(path, line, row, "input_length", "output_length", drop)
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not ids or not all(is_int(h) and h >= 0 for h in ids):
            raise bad_field(path, line, "hash_ids", ids, "must be a non-empty list of integers >= 0")
        if lens is None:
            dropped += 1
            continue
        if lens[0] > len(ids) * size:
            raise bad_field(path, line, "input_length", lens[0], f"must be at most len(hash_ids) x block_tokens = "
                       f"{len(ids)} x {size}")
        ids = ids[:-(-lens[0] // size)]
        fresh = 0
        for k, h in enumerate(ids):  # a block read further than before is drawn anew (earlier prompts keep theirs)
            need = min(size, lens[0] - k * size)
            if need > drawn.get(h, 0):
                drawn[h] = need
                fresh += need
        more_prompt_tokens(memory, lens[0], path, line, where, fresh, " (or make a trace of fewer --hours "
                           "with experiments.make_mooncake_trace)")
        items.append((t, ids, lens[0], lens[1]))
    blocks: dict[int, list[int]] = {}  # once every row is read and checked
    for k, (t, ids, n, out) in enumerate(items):
        prompt: list[int] = []
        for h in ids:  # a block is drawn as far as a prompt reads it
            need = min(size, n - len(prompt))
            block = blocks.get(h)
            if block is None or len(block) < need:  # the first `need` ids of the block's draw
                block = blocks[h] = np.random.default_rng([seed, h]).integers(0, vocab_size, size=need).tolist()
            prompt += block[:need]
        items[k] = (t, prompt, out)
    return workload(str(cfg.get("name", "mooncake")), path, items, scale, dropped)
