"""How long the prefill attention kernel's programs keep the GPU busy, in key tiles.

The engine's prefill kernel (kernels/prefill.py) runs one program per (64-token query tile, group
of query heads sharing a KV head); a program walks the key tiles its last row sees (prefix plus the
causal part), so its cost is that many key tiles.  At engine prefill sizes (up to a few thousand
tokens) there are a few hundred programs for ~132 SMs, so the kernel's time is set by how they pack
onto the SMs, not by the total number of (query, key) pairs: one 1792-token prompt has a 14-tile
program on its critical path, four 448-token prompts have 4-tile ones, whatever the pair counts say.
`PrefillSchedule.makespan` packs the programs heaviest first onto `concurrent` slots (list
scheduling, as the hardware hands a freed SM the next program) and returns the busiest slot's
load in key tiles.  The profiler fits seconds per key tile from its split rows
(experiments/lib/profiling/grid.py) and the profiled latency model prices a step's prefill layout by
the difference in makespan from the one-sequence layout its grid measured.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

FIELDS = ("tokens_per_tile", "keys_per_tile", "programs_per_tile", "concurrent")


@dataclass(slots=True, frozen=True)
class PrefillSchedule:
    tokens_per_tile: int  # new tokens per program (query tile)
    keys_per_tile: int  # keys per step of a program's loop
    programs_per_tile: int  # programs per query tile (KV-head groups)
    concurrent: int  # programs that run at once (SMs x programs per SM)

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"prefill schedule {name}={value!r} is invalid: must be an integer >= 1")

    @classmethod
    def parse(cls, text: str) -> PrefillSchedule:
        """'tokens_per_tile=64 keys_per_tile=128 programs_per_tile=8 concurrent=132' (any order)."""
        values: dict[str, int] = {}
        for item in text.replace(",", " ").split():
            key, sep, raw = item.partition("=")
            if not sep or key not in FIELDS or key in values:
                raise ValueError(f"prefill schedule {text!r} is invalid: expected each of {', '.join(FIELDS)} "
                                 f"once as key=integer, got {item!r}")
            try:
                values[key] = int(raw)
            except ValueError:
                raise ValueError(f"prefill schedule {text!r} is invalid: {key}={raw!r} is not an integer") from None
        missing = [f for f in FIELDS if f not in values]
        if missing:
            raise ValueError(f"prefill schedule {text!r} is invalid: lacks {', '.join(missing)}")
        return cls(**values)

    def format(self) -> str:
        return " ".join(f"{name}={getattr(self, name)}" for name in FIELDS)

    def makespan(self, chunks: tuple[tuple[int, int], ...]) -> int:
        """Key tiles on the busiest slot for prefill chunks given as (new tokens q, prefix c)."""
        return _makespan(self, tuple(sorted(chunks)))

    def single(self, num_tokens: int) -> int:
        """Makespan of one prompt of num_tokens new tokens (the layout of the profile's grid rows)."""
        return self.makespan(((num_tokens, 0),)) if num_tokens > 0 else 0


@lru_cache(maxsize=65536)
def _makespan(schedule: PrefillSchedule, chunks: tuple[tuple[int, int], ...]) -> int:
    t, k = schedule.tokens_per_tile, schedule.keys_per_tile
    costs = []
    for q, c in chunks:
        for start in range(0, q, t):
            keys = c + min(start + t, q)
            costs.append(-(-keys // k))
    costs.sort(reverse=True)
    slots = [0] * min(schedule.concurrent, max(1, len(costs) * schedule.programs_per_tile))
    for cost in costs:
        for _ in range(schedule.programs_per_tile):
            heapq.heapreplace(slots, slots[0] + cost)
    return max(slots)
