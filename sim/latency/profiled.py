"""Latency model interpolated from a measured profile (`experiments/profiles/<gpu>-<model>.csv`;
schema in sim/latency/profile_io.py).

A step is priced from the profile's grid (step_grid.py: multilinear in prefill tokens, decodes,
context per decode and, where measured, longest context / mean), then corrected for what the grid's
rows do not vary: the CUDA-graph token padding of a step with prefill (token_padding.py), and a
prefill layout other than one sequence with no prefix (prefill_schedule.py's makespan times
`prefill_tile_s`, else the causal-attention pair count times `prefill_pair_s`). An async profile's
`sync_time_s` grid prices the steps not scheduled ahead; `admission_s`, the engine's host cost of admitting
a request, delays arrivals (sim/simulator.py). Swaps are piecewise linear in the block
count, scaled by block_size / the profile's block_size.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from policies.outputs import SchedulerOutput
from sim.latency.base import BatchShape, LatencyModel, shape_decode_times
from sim.latency.build import LATENCY_MODELS, LatencyConfig, LatencySetup
from sim.latency.file_meta import check_device
from sim.latency.prefill_schedule import PrefillSchedule
from sim.latency.profile_io import ProfileRows, meta_number, meta_sizes, read_profile
from sim.latency.step_grid import GridAxes, Times, segment
from sim.latency.token_padding import padded


@dataclass(kw_only=True)
class ProfiledConfig(LatencyConfig):
    path: str | None = None  # the profile (a caller resolves a relative path before building)


@LATENCY_MODELS.register("profiled", config=ProfiledConfig)
class ProfiledModel(LatencyModel):
    name = "profiled"

    @classmethod
    def from_config(cls, config: ProfiledConfig, setup: LatencySetup) -> ProfiledModel:
        return cls(config.path, setup.block_size, model_name=setup.model.name, hardware_name=setup.hardware.name,
                   tensor_parallel_size=setup.tensor_parallel_size, async_scheduling=setup.async_scheduling,
                   kv_reread_cost=setup.hardware.kv_reread_cost)

    def __init__(self, path: str | Path, block_size: int, model_name: str | None = None,
                 async_scheduling: bool | None = None, tensor_parallel_size: int = 1,
                 kv_reread_cost: float = 1.0, hardware_name: str | None = None) -> None:
        """`model_name`, `hardware_name` (conf/hardware's `name`): the runs', checked against the
        profile's `model` and `device` (sim/latency/file_meta.py `check_device`). `async_scheduling`:
        the runs' scheduler mode, checked against the profile's (a profile without the key was taken
        synchronously); `tensor_parallel_size`: the runs' GPUs per model,
        checked against the profile's `tensor_parallel_size` (1 when absent): a profile's step
        times are those of the size it was measured at. `kv_reread_cost` (`Hardware.kv_reread_cost`):
        the profile's decodes read distinct KV, so a decode batch's shared KV entries are priced as
        that fraction of a distinct one's."""
        self.set_reread_cost(kv_reread_cost, block_size)
        path = Path(path)
        self.path = path
        self.meta, rows = read_profile(path)
        measured_tp = int(self.meta.get("tensor_parallel_size", 1))
        if measured_tp != tensor_parallel_size:
            raise ValueError(f"latency profile {str(path)!r} was measured with tensor_parallel_size={measured_tp}, "
                             f"not parallel.tensor_parallel_size={tensor_parallel_size}: profile at that size "
                             "(python -m experiments.profile tensor_parallel_size=N) or pick its profile")
        if model_name is not None and self.meta.get("model") not in (None, model_name):
            raise ValueError(f"latency profile {str(path)!r} was measured for model={self.meta['model']!r}, "
                             f"not model={model_name!r}: profile that model or pick its profile")
        check_device(f"latency profile {str(path)!r}", self.meta.get("device"), hardware_name)
        mode = self.meta.get("async_scheduling", "false")  # "any": computed, not measured in one mode
        profiled_ahead = mode == "true"
        if async_scheduling is not None and mode != "any" and async_scheduling != profiled_ahead:
            raise ValueError(f"scheduler.async_scheduling={async_scheduling} is invalid with latency profile "
                             f"{str(path)!r}, measured with async_scheduling={profiled_ahead}: profile in the runs' "
                             "mode (python -m experiments.profile async_scheduling=...)")
        profile_bs = int(self.meta.get("block_size", block_size))
        self._block_scale = block_size / profile_bs
        rows_by_point = ProfileRows.parse(path, rows)
        self.axes = GridAxes.of(rows_by_point.steps)
        self.uses_longest_context = self.axes.has_ratio
        self.grid = self.axes.fill(path, rows_by_point.steps, "time_s")
        # Async profiles: each row also as the synchronous loop pays it, for steps not scheduled ahead.
        self.sync_grid = (self.axes.fill(path, rows_by_point.sync_steps, "sync_time_s")
                          if rows_by_point.sync_steps else None)
        self.prefill_pair_s = meta_number(path, self.meta, "prefill_pair_s")
        self.prefill_tile_s = meta_number(path, self.meta, "prefill_tile_s")
        self.admission_s = meta_number(path, self.meta, "admission_s")
        self.prefill_schedule: PrefillSchedule | None = None
        if "prefill_schedule" in self.meta:
            try:
                self.prefill_schedule = PrefillSchedule.parse(self.meta["prefill_schedule"])
            except ValueError as exc:
                raise ValueError(f"{path}: metadata {exc}") from None
        self.graph_sizes = meta_sizes(path, self.meta, "decode_graph_sizes")
        self.token_sizes = meta_sizes(path, self.meta, "token_graph_sizes")
        self.pad_token_s = self.axes.unpad(self.grid, self.token_sizes) if self.token_sizes else 0.0
        if self.sync_grid is not None and self.token_sizes:
            self.axes.unpad(self.sync_grid, self.token_sizes)
        swaps = rows_by_point.swaps
        self.swap_axis = sorted(swaps)
        self._swap_times = [statistics.median(swaps[n]) for n in self.swap_axis]
        if len(self.swap_axis) == 1:  # one measurement: proportional through the origin
            self.swap_axis.insert(0, 0)
            self._swap_times.insert(0, 0.0)

    def step_time(self, out: SchedulerOutput) -> float:
        if not out.scheduled:
            return 0.0
        return self.shape_time(BatchShape.of(out, self.uses_longest_context, self._shared_block_size),
                               sync=self.sync_grid is not None and not out.ahead)

    def decode_times(self, num_seqs: int, num_context_tokens: int, num_samples: int,
                     num_steps: int, max_context_tokens: int = 0,
                     num_shared_context_tokens: int = 0) -> list[float]:
        return shape_decode_times(self.shape_time, num_seqs, num_context_tokens, num_samples, num_steps,
                                  max_context_tokens, num_shared_context_tokens)

    def shape_time(self, b: BatchShape, sync: bool = False) -> float:
        """Step time of a batch that schedules something (`sync`: not scheduled ahead, priced from
        an async profile's sync_time_s)."""
        p, d = b.num_prefill_tokens, b.num_decode_seqs
        if p == 0 and self.graph_sizes:
            d = next((s for s in self.graph_sizes if s >= d), d)
        context = b.kv_read_tokens(self.kv_reread_cost)
        t = self.lookup(p, d, context, self.sync_grid if sync else None, b.max_context_tokens)
        if p and self.pad_token_s:
            t += self.pad_token_s * (padded(p + d, self.token_sizes) - p - d)
        if p and self.prefill_schedule is not None and self.prefill_tile_s and b.prefill_chunks:
            schedule = self.prefill_schedule
            t += self.prefill_tile_s * (schedule.makespan(b.prefill_chunks) - self._as_grid_prices(schedule.single, p))
        elif p and self.prefill_pair_s:
            t += self.prefill_pair_s * (b.prefill_attention_pairs - self._as_grid_prices(_causal_pairs, p))
        return max(t, 0.0)

    def _as_grid_prices(self, attention: Callable[[int], float], p: int) -> float:
        """The grid rows' own attention (one sequence of `p` tokens) as the grid prices it: exact
        within the grid, and beyond its largest prefill row extended along its last segment, as the
        grid's price is. The layout correction removes this and adds the step's real attention: with
        the quadratic single-sequence attention removed from a linearly extended price, a step of
        eight 1,024-token prompts (8,192 tokens, 2,048 the largest row) was priced below one of four."""
        last, before = self.axes.prefill[-1], self.axes.prefill[-2] if len(self.axes.prefill) > 1 else 0
        if p <= last or last <= before:
            return attention(p)
        return attention(last) + (p - last) * (attention(last) - attention(before)) / (last - before)

    def lookup(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int,
               grid: Times | None = None, max_context_tokens: int = 0) -> float:
        """The grid's multilinear price (step_grid.py) of a step's rows, before layout corrections."""
        return self.axes.interpolate(self.grid if grid is None else grid, num_prefill_tokens, num_decode_seqs,
                                     num_context_tokens, max_context_tokens)

    def swap_time(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        x = num_blocks * self._block_scale
        i, w = segment(self.swap_axis, x)
        ts = self._swap_times
        return max(ts[i] + w * (ts[i + 1] - ts[i]), 0.0)


def _causal_pairs(num_tokens: int) -> int:
    """(query, key) pairs of one prompt's causal attention."""
    return num_tokens * (num_tokens + 1) // 2
