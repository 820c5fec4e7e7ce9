"""The operator grid (config group `operator_grid`, conf/operator_grid/*.yaml): the sizes
`python -m experiments.profile mode=operators` times each operator at.

The grid is generic, not taken from any model: GEMMs over powers of two of tokens (m), input (k)
and output (n) widths; attention over head dims, KV heads, query heads per KV head, batch and
context; elementwise ops over tokens and widths; the sequence-parallel boundaries (the collectives
part) over their steps' rows (`sequence_parallel_m`, optional) and the GEMM widths. A model's
shapes at any tensor-parallel size fall between its points (sim/latency/operators.py interpolates
in log space; the GEMM cells the caps skip are filled by a least-squares fit,
sim/latency/operator_profile.py).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from itertools import pairwise
from typing import Any

# Lists a grid may leave out or empty (no rows of their ops).
OPTIONAL_LISTS = ("sequence_parallel_m",)


def _sizes(d: Mapping[str, Any], key: str, low: int) -> list[int]:
    v = d.get(key)
    if key in OPTIONAL_LISTS and (v is None or (isinstance(v, (list, tuple)) and not v)):
        return []
    if not isinstance(v, (list, tuple)) or not v or any(
            isinstance(x, bool) or not isinstance(x, int) or x < low for x in v):
        what = "a list" if key in OPTIONAL_LISTS else "a non-empty list"
        raise ValueError(f"operator_grid.{key}={v!r} is invalid: must be {what} of integers >= {low}")
    if any(b <= a for a, b in pairwise(v)):
        raise ValueError(f"operator_grid.{key}={list(v)!r} is invalid: must be strictly increasing")
    return list(v)


@dataclass(slots=True)
class OperatorGrid:
    gemm_m: list[int]
    gemm_k: list[int]
    gemm_n: list[int]
    head_dims: list[int]
    kv_heads: list[int]
    groups: list[int]  # query heads per KV head
    decode_seqs: list[int]
    decode_context: list[int]
    prefill_tokens: list[int]
    prefill_context: list[int]  # may start at 0 (no prefix)
    tokens: list[int]  # elementwise ops, sampler rows are `sample_rows`
    widths: list[int]
    sample_rows: list[int]
    vocab: list[int]
    copy_bytes: list[int]
    swap_bytes: list[int]
    launch_kernels: list[int]
    collective_bytes: list[int]
    world_sizes: list[int]  # collectives; those above the machine's GPU count are skipped
    # The sequence-parallel boundaries' rows (all_gather_matmul, matmul_reduce_scatter: a step's rows,
    # gathered), timed at each world size that divides them; empty: none timed.
    sequence_parallel_m: list[int] = field(default_factory=list)
    # The fused all-reduce + add + RMSNorm rows' width (elements): the hidden size of the model the
    # simulator prices them for (4096: Qwen3-8B's); other widths are priced unfused.
    fused_norm_width: int = 4096
    gemm_max_flops: float = 2.0e12  # GEMMs above 2 m k n are not timed (filled by the fit)
    gemm_max_weight_bytes: int = 2**31
    attention_max_kv_bytes: int = 2**33  # the largest decode problem's KV cache must fit under it
    block_size: int = 16
    target_ms: float = 5.0  # per timing: CUDA-graph replays of about this long (GPU), wall time (CPU)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OperatorGrid:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"operator_grid.{unknown[0]} is unknown: keys are {sorted(known)}")
        lists = {f.name: _sizes(d, f.name, 0 if f.name == "prefill_context" else 1)
                 for f in fields(cls) if f.type == "list[int]"}
        if any(w < 2 for w in lists["world_sizes"]):
            raise ValueError(f"operator_grid.world_sizes={lists['world_sizes']} is invalid: sizes >= 2")
        scalars = {f.name: d[f.name] for f in fields(cls) if f.type != "list[int]" and f.name in d}
        for key, value in scalars.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"operator_grid.{key}={value!r} is invalid: must be a number > 0")
        width = scalars.get("fused_norm_width", 1)
        if not isinstance(width, int):
            raise ValueError(f"operator_grid.fused_norm_width={width!r} is invalid: an integer >= 1 (elements)")  # noqa: TRY004
        grid = cls(**lists, **scalars)
        kv_bytes = 2 * 2 * max(grid.decode_seqs) * max(grid.decode_context) * max(grid.kv_heads) * max(grid.head_dims)
        if kv_bytes > grid.attention_max_kv_bytes:
            raise ValueError(f"operator_grid: the largest decode problem ({max(grid.decode_seqs)} x "
                             f"{max(grid.decode_context)} tokens) holds {kv_bytes} bytes of bf16 KV, over "
                             f"attention_max_kv_bytes={grid.attention_max_kv_bytes}: shrink decode_seqs or "
                             "decode_context, or raise the cap if the GPU holds it")
        return grid

    def gemm_cells(self, itemsize: int, ms: list[int] | None = None) -> Iterator[tuple[int, int, list[int]]]:
        """(k, n, the m timed at them) for every weight [n, k] of `itemsize`-byte elements within
        `gemm_max_weight_bytes`; the m: those of `ms` (default `gemm_m`) whose 2 m k n is within
        `gemm_max_flops` (the cells over either cap are filled by the fit)."""
        ms = self.gemm_m if ms is None else ms
        for k in self.gemm_k:
            for n in self.gemm_n:
                if k * n * itemsize <= self.gemm_max_weight_bytes:
                    yield k, n, [m for m in ms if 2 * m * k * n <= self.gemm_max_flops]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
