"""What the public-trace importers (azure.py, burstgpt.py, mooncake.py) share: reading their length
fields, rows with no prompt or output tokens, and the workload they make; and, for the traces of
lengths alone (azure.py, burstgpt.py), the rows they keep (`LengthRows`).

Public traces record lengths, not text: prompts are drawn token ids (seeded), except where a format
records which blocks requests share (Mooncake's hash ids). Every request replays its recorded
output length (`max_tokens` = the length, `ignore_eos`). A row with 0 prompt or output tokens (a
failed request in BurstGPT) cannot be replayed: it is an error naming file, line and field, unless
`drop_empty: true` leaves such rows out (with a warning giving their number).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from experiments.lib.workloads.base import Workload
from experiments.lib.workloads.common import LENGTH, PromptMemory, make_request
from experiments.lib.workloads.replay import as_int, bad_field, more_prompt_tokens


def lengths(path: Path, line: int, row: Mapping[str, Any], prompt_field: str, output_field: str,
            drop_empty: bool) -> tuple[int, int] | None:
    """(prompt tokens, output tokens) of a row, or None for an empty row left out."""
    prompt = as_int(path, line, row, prompt_field, 0, LENGTH)
    output = as_int(path, line, row, output_field, 0, LENGTH)
    if prompt and output:
        return prompt, output
    if drop_empty:
        return None
    field = prompt_field if not prompt else output_field
    raise bad_field(path, line, field, row.get(field), "must be an integer >= 1 (set drop_empty: true to "
               "leave out rows with no prompt or output tokens)")


def drop_empty(cfg: Mapping[str, Any], where: str) -> bool:
    v = cfg.get("drop_empty", False)
    if type(v) is not bool:
        raise ValueError(f"{where}.drop_empty={v!r} is invalid: must be true or false")
    return v


def drawn_prompts(items: list[tuple[float, int, int]], seed: int, vocab_size: int
                  ) -> list[tuple[float, list[int], int]]:
    """(arrival, prompt, output length) for each (arrival, prompt length, output length), in order:
    prompts of token ids drawn from the seed (once every row is read and checked)."""
    rng = np.random.default_rng(seed)
    return [(t, rng.integers(0, vocab_size, size=n).tolist(), out) for t, n, out in items]


def workload(name: str, path: Path, items: list[tuple[float, list[int], int]], scale: float,
             num_dropped: int) -> Workload:
    """A workload of (arrival seconds from the trace's first request, prompt, output length) items
    in file order: arrival times scaled and shifted to start at 0, sorted (stable), ids = row index."""
    if num_dropped:
        warnings.warn(f"{path}: left out {num_dropped} rows with no prompt or output tokens (drop_empty)",
                      stacklevel=2)
    if not items:
        raise ValueError(f"{path}: no request left to replay")
    start = min(t for t, _, _ in items)
    order = sorted(range(len(items)), key=lambda k: (items[k][0], k))
    requests, outs = [], []
    for k in order:
        t, prompt, out = items[k]
        requests.append(make_request(str(k), prompt, out, None, (t - start) * scale, 0))
        outs.append(out)
    return Workload(name, requests, outs)


@dataclass(slots=True)
class LengthRows:
    """The rows of a trace of lengths alone (no token ids, no shared blocks), read in file order:
    each row's lengths (`lengths`: an empty row left out and counted, or refused), its prompt tokens
    counted against the workload's bound (replay.py `more_prompt_tokens`), its (arrival, prompt
    length, output length) kept; the prompts are drawn once every row is read and checked."""

    path: Path
    where: str  # the config's key, for the errors
    drop_empty: bool
    items: list[tuple[float, int, int]] = field(default_factory=list)
    dropped: int = 0
    memory: PromptMemory = field(default_factory=PromptMemory)

    def add(self, line: int, row: Mapping[str, Any], arrival: float, prompt_field: str, output_field: str) -> None:
        """Row `line` of the file, arriving at `arrival` (seconds, before scaling), its lengths in the two fields."""
        lens = lengths(self.path, line, row, prompt_field, output_field, self.drop_empty)
        if lens is None:
            self.dropped += 1
            return
        more_prompt_tokens(self.memory, lens[0], self.path, line, self.where)
        self.items.append((arrival, *lens))

    def workload(self, name: str, seed: int, vocab_size: int, scale: float) -> Workload:
        """The workload of the rows kept, their prompts drawn from `seed`."""
        return workload(name, self.path, drawn_prompts(self.items, seed, vocab_size), scale, self.dropped)
