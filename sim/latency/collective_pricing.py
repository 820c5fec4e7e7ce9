"""How the operator model prices a step's all-reduces and all-gathers at its tensor-parallel size N
(`latency.collectives`, docs/operator_profiles.md "Collectives at a world size nobody measured"):

- `measured` (the default): the operator profile's rows at world size N; a size without them is
  refused, naming the world sizes that were measured and this option.
- `measured_else_ring`: those rows where the profile has them; otherwise the ring formulas of
  sim/latency/tensor_parallel.py (`RingLink`: latency + 2 (N-1)/N bytes / bandwidth for an
  all-reduce, latency + (N-1)/N bytes / bandwidth for an all-gather) on the hardware's
  `interconnect_bandwidth` and `interconnect_latency_s`, calibrated by the same GPU type's rows at
  a measured world size M when it has any, at each measured message size n:

      t_N(n) = t_M(n) x ring_N(n) / ring_M(n)

  (M: the largest measured size below N, else the smallest above; between and beyond the sizes the
  rows' interpolation). Where the transfer dominates this holds the bus bandwidth NCCL reaches at
  each message size (nccl-tests' busbw: algbw x 2 (N-1)/N for an all-reduce, (N-1)/N for an
  all-gather, defined so that it does not depend on the rank count) at the figure measured at M;
  on an NVSwitch board every GPU has the same link whatever N. Where the latency dominates
  (ring_N ~ ring_M ~ latency) it keeps the floor measured at M, which the real floor exceeds at
  larger N (more ring or tree steps): small messages are priced optimistically. A GPU type without
  collective rows at any size gets the ring formulas on its datasheet figures alone.

Every priced world size says where its times came from (`PricedCollectives.source`), which runs
and searches report.

The all-reduce is then priced as the engine runs it (`price_engine_all_reduce`): each message by the path
the engine's own rule picks for its bytes at the run's `parallel` settings (`EngineAllReduce.path`:
one-shot and two-shot over symmetric memory up to their bounds, NCCL above), from the profile's
`all_reduce_one_shot` / `all_reduce_two_shot` rows at N. Where the engine takes NCCL for every
message (`parallel.disable_custom_all_reduce=true`, a world size its kernels do not take), or the
profile has no symmetric-memory rows at N, or N is priced by the ring model, every message is
priced as NCCL's, and the one line saying so tells which. The symmetric paths are priced from
the rows of torch's kernels whatever kernels the engine runs (`EngineAllReduce.kernel`): the Triton
one-shot and two-shot kernels ("triton", and the unfused all-reduces of "triton_fused") are not
profiled, and the line says so.

The engine's fused layer boundary (`all_reduce_kernel` resolving to "triton_fused" or
"triton_lamport", `ParallelConfig.kernel_for`) sums each decoder layer's o_proj and down_proj
partial sums inside the next RMSNorm: one kernel does the all-reduce, the residual add and the norm
(engine/models/llama.py `ReducingRMSNorm`). `price_fused_boundary` prices such a boundary from the
profile's rows of the engine's kernel at N (`FUSED_BOUNDARY_OPS`: `all_reduce_add_rms_norm`, or
`all_reduce_add_rms_norm_lamport`; the Lamport kernel's from the fused kernel's rows where the
profile has none of its own, and the line says so), at the model's hidden width, in place of
all-reduce + `add_rms_norm`; where the engine falls back to the two (a message of NCCL's size, rows
wider than the kernel takes), so does the price. A profile without those rows at N and width, or an
N priced by the ring model, prices every boundary unfused, and the line says so.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sim.latency.build import EngineAllReduce
from sim.latency.op_grid import OpGrid
from sim.latency.operator_file import (
    ALL_REDUCE_PATH_OPS,
    COLLECTIVES,
    FUSED_ALL_REDUCE,
    FUSED_BOUNDARY_OPS,
    SYMMETRIC_ALL_REDUCES,
)
from sim.latency.operator_profile import OperatorProfile
from sim.latency.shapes import Hardware
from sim.latency.tensor_parallel import RingLink

COLLECTIVE_MODES = ("measured", "measured_else_ring")
# PricedCollectives.kind values.
MEASURED, RING_CALIBRATED, RING_DATASHEET = "measured", "ring_calibrated", "ring_datasheet"
NCCL_PATH = next(path for path, op in ALL_REDUCE_PATH_OPS.items() if op == "all_reduce")  # "nccl"


@dataclass(slots=True, frozen=True)
class PricedCollectives:
    """Seconds of an all-reduce (bytes of the result) and of an all-gather (bytes of its output)
    at one world size, and where they come from."""

    all_reduce: Callable[[float], float]
    all_gather: Callable[[float], float]
    kind: str  # MEASURED, RING_CALIBRATED or RING_DATASHEET
    source: str  # one line for a reader: the files, the hardware figures, the calibration


def check_mode(mode: object) -> str:
    if mode not in COLLECTIVE_MODES:
        raise ValueError(f"latency.collectives={mode!r} is invalid: one of {list(COLLECTIVE_MODES)} (measured: only "
                         "world sizes the operator profile measured; measured_else_ring: the others from the "
                         "hardware's interconnect, docs/operator_profiles.md)")
    return str(mode)


def price_collectives(profile: OperatorProfile, size: int, mode: str = "measured",
                      hardware: Hardware | None = None) -> PricedCollectives:
    """The collectives of `size` GPUs under `mode` (COLLECTIVE_MODES); raises ValueError naming the
    field at fault."""
    mode = check_mode(mode)
    if all(profile.has(op, size) for op in COLLECTIVES):
        return PricedCollectives(profile.grid("all_reduce", size), profile.grid("all_gather", size), MEASURED,
                                 f"measured at N={size} ({', '.join(_files(profile, size))})")
    missing = next(op for op in COLLECTIVES if not profile.has(op, size))
    if mode == "measured":
        raise ValueError(
            f"parallel.tensor_parallel_size={size} has no {missing} data in the operator profile "
            f"{[str(p) for p in profile.paths]}: measured at world sizes {profile.world_sizes(missing) or 'none'}; "
            f"take them on a machine with {size} GPUs (python -m experiments.profile mode=operators "
            "operator_parts=[collectives]), or price them from the hardware's interconnect with "
            "latency.collectives=measured_else_ring")
    if hardware is None:
        raise ValueError(f"latency.collectives={mode!r} needs the run's hardware (its interconnect figures) to price "
                         f"parallel.tensor_parallel_size={size}")
    try:
        link = RingLink.of(hardware, size)
    except ValueError as e:
        raise ValueError(f"latency.collectives={mode!r} cannot price parallel.tensor_parallel_size={size}: {e}") from None
    figures = (f"conf/hardware/{hardware.name}.yaml interconnect {link.bandwidth / 1e9:g} GB/s, "
               f"{link.latency_s * 1e6:g} us")
    measured = sorted(set(profile.world_sizes("all_reduce")) & set(profile.world_sizes("all_gather")))
    if not measured:
        return PricedCollectives(link.all_reduce_s, link.all_gather_s, RING_DATASHEET,
                                 f"ring model at N={size} on datasheet figures ({figures}; no collective rows for "
                                 f"{hardware.name})")
    below = [m for m in measured if m < size]
    base = max(below) if below else min(measured)
    base_link = RingLink.of(hardware, base)
    all_reduce = _scaled(profile.grid("all_reduce", base), link.all_reduce_s, base_link.all_reduce_s)
    all_gather = _scaled(profile.grid("all_gather", base), link.all_gather_s, base_link.all_gather_s)
    return PricedCollectives(all_reduce, all_gather, RING_CALIBRATED,
                             f"ring model at N={size} x measured/model at N={base} per message size "
                             f"({', '.join(_files(profile, base))}; {figures})")


def price_engine_all_reduce(profile: OperatorProfile, size: int, priced: PricedCollectives,
                            engine: EngineAllReduce | None) -> tuple[Callable[[float], float], str]:
    """Seconds of the all-reduce the engine runs at `size` GPUs, per message of `bytes`, and one
    line saying what they rest on (`engine`: the run's paths; None: not known, priced as NCCL)."""
    nccl = "NCCL rows" if priced.kind == MEASURED else "the ring model"
    if engine is None:
        return priced.all_reduce, f"all-reduce: {nccl} (the engine's all-reduce paths were not given)"
    if engine.off_reason is not None:
        return priced.all_reduce, (f"all-reduce: {nccl}, as the engine runs it (symmetric memory off: "
                                   f"{engine.off_reason})")
    bounds = f"one-shot up to {engine.one_shot_max_bytes} bytes, two-shot up to {engine.two_shot_max_bytes}"
    if priced.kind != MEASURED or not all(profile.has(op, size) for op in SYMMETRIC_ALL_REDUCES):
        where = (f"no symmetric-memory rows in this profile at N={size}" if priced.kind == MEASURED
                 else f"no symmetric-memory pricing at an unmeasured N={size}")
        return priced.all_reduce, (f"all-reduce: {nccl} ({where}; the engine's small messages are "
                                   f"faster: {bounds} over symmetric memory)")
    grids = {path: priced.all_reduce if op == "all_reduce" else profile.grid(op, size)
             for path, op in ALL_REDUCE_PATH_OPS.items()}
    files = list(dict.fromkeys(f for op in SYMMETRIC_ALL_REDUCES for f in profile.files(op, size)))
    kernels = "" if engine.kernel == "torch" else f", torch's kernels' rows for the engine's {engine.kernel} kernels"
    return _by_path(engine.path, grids), (f"all-reduce: the engine's paths, {bounds} (symmetric-memory rows, "
                                          f"{', '.join(files)}{kernels}), NCCL rows above")


def price_fused_boundary(profile: OperatorProfile, size: int, priced: PricedCollectives,
                         engine: EngineAllReduce | None, hidden: int) -> tuple[Callable[[float], float | None] | None,
                                                                               str | None]:
    """The seconds of the engine's fused boundary (all-reduce + residual add + RMSNorm of rows
    `hidden` wide) per message of `bytes`, None for a message the engine falls back on (NCCL's
    size); and one line on it. (None, line): every boundary priced unfused, the line saying why;
    (None, None): the engine does not fuse them."""
    if engine is None or engine.off_reason is not None or engine.fuses_width is None:
        return None, None
    unfused = "fused boundary: priced as all-reduce + add_rms_norm"
    if not engine.fuses_width(hidden):
        return None, f"{unfused}, as the engine runs rows of {hidden} elements (wider than its fused kernel takes)"
    if priced.kind != MEASURED:
        return None, f"{unfused} (no fused-boundary pricing at an unmeasured N={size}; the engine fuses them)"
    op, instead = FUSED_BOUNDARY_OPS.get(engine.kernel, FUSED_ALL_REDUCE), ""
    if op != FUSED_ALL_REDUCE and not profile.has(op, size):  # a kernel without rows of its own
        op, instead = FUSED_ALL_REDUCE, f" for the engine's {engine.kernel} kernel (no {op} rows at N={size})"
    if not profile.has(op, size):
        return None, (f"{unfused} (no {op} rows in this profile at N={size}; the engine fuses them: "
                      "take them with python -m experiments.profile mode=operators operator_parts=[collectives])")
    grid = profile.grid(op, size)
    widths = [int(w) for w in grid.axes[1].points]
    if hidden not in widths:
        return None, (f"{unfused} (the {op} rows at N={size} are {widths} wide, the model's rows "
                      f"{hidden}; the engine fuses them: take them at operator_grid.fused_norm_width={hidden})")
    seconds = grid.fix("n", hidden)
    seen: dict[float, float | None] = {}

    def fused(nbytes: float) -> float | None:
        if nbytes not in seen:
            seen[nbytes] = None if engine.path(int(nbytes)) == NCCL_PATH else seconds(nbytes)
        return seen[nbytes]
    return fused, (f"fused boundary: {op} rows ({', '.join(profile.files(op, size))}){instead} "
                   "in place of all-reduce + add_rms_norm, all-reduce + add_rms_norm at NCCL's sizes")


def _by_path(path: Callable[[int], str], grids: dict[str, Callable[[float], float]]) -> Callable[[float], float]:
    """A message's time on the path `path` picks for its bytes (memoized: steps repeat sizes)."""
    seen: dict[float, float] = {}

    def seconds(nbytes: float) -> float:
        t = seen.get(nbytes)
        if t is None:
            t = seen[nbytes] = grids[path(int(nbytes))](nbytes)
        return t
    return seconds


def _files(profile: OperatorProfile, size: int) -> list[str]:
    return list(dict.fromkeys(f for op in COLLECTIVES for f in profile.files(op, size)))


def _scaled(measured: OpGrid, ring: Callable[[float], float], ring_base: Callable[[float], float]) -> OpGrid:
    """The measured times at each of their sizes, times ring / ring_base there."""
    (axis,) = measured.axes
    return OpGrid.of_times(measured.axes, np.array([measured(n) * ring(n) / ring_base(n) for n in axis.points]))
