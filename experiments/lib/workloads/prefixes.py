"""Shared system prompts: `system_prompts: {num: K, len: L, zipf: s}` makes K prompts of L drawn
token ids, and each request (or session) starts with one of them: prompt k (k = 1..K) is drawn with
probability proportional to 1 / k^s, so s = 0 is uniform and larger s skews traffic onto the first
few (a few popular system prompts and a long tail, where cache-aware routing can overload the
replica holding the popular one)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from experiments.lib.workloads.common import COUNT, LENGTH, PromptMemory, get_int, is_num


@dataclass(kw_only=True)
class SystemPromptsSpec:
    """The `system_prompts` key of a workload's config."""

    num: int | None = None
    len: int | None = None
    zipf: float | None = None


@dataclass(slots=True)
class SystemPrompts:
    prompts: list[list[int]]
    probabilities: np.ndarray

    @staticmethod
    def size(spec: Any, where: str) -> tuple[int, int]:
        """(num, len) of a spec, checked before anything is drawn; (0, 0) for none."""
        if spec is None:
            return 0, 0
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where}={spec!r} is invalid: give {{num, len, zipf}} or null")  # noqa: TRY004
        num, length = get_int(spec, "num", where, 1, COUNT), get_int(spec, "len", where, 1, LENGTH)
        PromptMemory().add(num * length, num * length, f"{where}={{num: {num}, len: {length}}}",
                           "use fewer or shorter ones")
        return num, length

    @classmethod
    def from_spec(cls, spec: Any, rng: np.random.Generator, high: int, where: str) -> SystemPrompts | None:
        """None for no spec; token ids in [0, high)."""
        num, length = cls.size(spec, where)
        if not num:
            return None
        s = spec.get("zipf", 0.0)
        s = 0.0 if s is None else s
        if not is_num(s) or not 0 <= s < float("inf"):
            raise ValueError(f"{where}.zipf={s!r} is invalid: must be a finite number >= 0 (0: uniform)")
        weights = 1.0 / np.arange(1, num + 1, dtype=float) ** float(s)
        prompts = rng.integers(0, high, size=(num, length)).tolist()
        return cls(prompts, weights / weights.sum())

    def draw(self, n: int, rng: np.random.Generator) -> list[int]:
        """The system prompt index of each of n requests."""
        return rng.choice(len(self.prompts), size=n, p=self.probabilities).tolist()
