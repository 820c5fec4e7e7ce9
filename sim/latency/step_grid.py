"""A profile's step times on its full grid and their multilinear interpolation.

The axes are the distinct prefill-token counts, decode counts, contexts per decode and (optional)
ratios of the longest decode context to the mean among the profile's step rows. Every combination
must have a row: a row with 0 decodes stands for every context, a row without a ratio for every
ratio. Between grid points a step's time is multilinear in the four axes (exact at grid points,
monotone where the data is); outside the grid it is extrapolated linearly from the last segment.
"""
from __future__ import annotations

import statistics
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

from sim.latency.profile_io import ANY_RATIO, RATIO_COLUMN, PointKey
from sim.latency.token_padding import padded, per_token_cost

# The ratio a step is priced at when its longest context is not given: the profiler's batches
# without the axis spread from 1/4 to 7/4 of the mean (experiments/lib/profiling/synthetic.py).
UNKNOWN_RATIO = 1.75

# times[prefill][decodes][context][ratio]
Times = list[list[list[list[float]]]]


def segment(axis: list[float], x: float) -> tuple[int, float]:
    """Index i and weight w with x = (1 - w) axis[i] + w axis[i + 1]; w outside [0, 1] extrapolates."""
    if len(axis) == 1:
        return 0, 0.0
    i = min(max(bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


@dataclass(frozen=True, slots=True)
class GridAxes:
    prefill: list[int]
    decode: list[int]
    context: list[float]  # context per decode
    ratio: list[float]  # [ANY_RATIO] when no row carries a ratio

    @classmethod
    def of(cls, points: dict[PointKey, list[float]]) -> GridAxes:
        return cls(sorted({k[0] for k in points}), sorted({k[1] for k in points}),
                   sorted({k[2] for k in points if k[1] > 0}) or [0.0],
                   sorted({k[3] for k in points if k[3] != ANY_RATIO}) or [ANY_RATIO])

    @property
    def has_ratio(self) -> bool:
        """Whether the profile measured the batch-shape axis (longest decode context / mean)."""
        return self.ratio != [ANY_RATIO]

    def fill(self, path: Path, points: dict[PointKey, list[float]], column: str) -> Times:
        """Each grid point's median (a row standing for every ratio fills its line); raises
        ValueError naming the first missing point."""
        grid = []
        for p in self.prefill:
            plane = []
            for d in self.decode:
                line_ = []
                for ctx in self.context:
                    ratios = []
                    for ratio in self.ratio:
                        key = (p, d, ctx if d else -1.0, ratio)
                        key = key if key in points else (*key[:3], ANY_RATIO)
                        if key not in points:
                            shown = "" if ratio == ANY_RATIO else f", {RATIO_COLUMN}={ratio}"
                            raise ValueError(
                                f"latency profile {str(path)!r} lacks the grid point num_prefill_tokens={p}, "
                                f"num_decode_seqs={d}, num_context_tokens={round(ctx * d)}{shown} ({column}): step "
                                "rows must cover every combination of the distinct prefill, decode, "
                                "context-per-decode (and context-ratio) values")
                        ratios.append(statistics.median(points[key]))
                    line_.append(ratios)
                plane.append(line_)
            grid.append(plane)
        return grid

    def unpad(self, grid: Times, token_sizes: list[int]) -> float:
        """Take each prefill row's CUDA-graph padding cost out of `grid` in place
        (token_padding.py); returns the cost per padding row (0 without a decode-free plane)."""
        if self.decode[0] != 0:
            return 0.0
        aligned = [(p, grid[i][0][0][0]) for i, p in enumerate(self.prefill) if p > 0 and p in token_sizes]
        cost = per_token_cost(aligned)
        for i, p in enumerate(self.prefill):
            for j, d in enumerate(self.decode):
                if p:
                    extra = cost * (padded(p + d, token_sizes) - p - d)
                    grid[i][j] = [[t - extra for t in ratios] for ratios in grid[i][j]]
        return cost

    def interpolate(self, grid: Times, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int,
                    max_context_tokens: int = 0) -> float:
        """Multilinear in (prefill tokens, decodes, context per decode, longest context / mean);
        `max_context_tokens` 0: the longest context is not known (UNKNOWN_RATIO)."""
        ctx = num_context_tokens / num_decode_seqs if num_decode_seqs else self.context[0]
        ip, wp = segment(self.prefill, num_prefill_tokens)
        idd, wd = segment(self.decode, num_decode_seqs)
        ic, wc = segment(self.context, ctx)
        ratio = UNKNOWN_RATIO
        if max_context_tokens and num_context_tokens:
            ratio = max_context_tokens * num_decode_seqs / num_context_tokens
        ir, wr = segment(self.ratio, ratio)
        total = 0.0
        for a, fa in ((ip, 1 - wp), (ip + 1, wp)):
            if fa == 0:
                continue
            for b, fb in ((idd, 1 - wd), (idd + 1, wd)):
                if fb == 0:
                    continue
                for c, fc in ((ic, 1 - wc), (ic + 1, wc)):
                    if fc == 0:
                        continue
                    line_ = grid[a][b][c]
                    for r, fr in ((ir, 1 - wr), (ir + 1, wr)):
                        if fr != 0:
                            total += fa * fb * fc * fr * line_[r]
        return max(total, 0.0)
