"""Which steps a tensor-parallel engine runs sequence-parallel, and on how many rows: one rule for
the engine (`TPGroup`, engine/models/sequence_parallel.py, its CUDA-graph buckets) and the
simulator's prices of those steps (sim/latency/sequence_parallel_pricing.py for the operator
model, sim/latency/sequence_parallel_roofline.py for the roofline).

`sequence_parallel_min_rows` (0: off): an eager forward of at least that many rows (the step's
tokens) at N > 1 ranks runs its layers sequence-parallel; the engine captures no token bucket
that large, so every such step is eager. Its rows are padded to a multiple of N, each rank holding
1/N of them between the layer boundaries.
"""
from __future__ import annotations

from collections.abc import Sequence


def check_min_rows(value: object, field: str = "sequence_parallel_min_rows") -> int:
    """The setting, or ValueError naming `field`, the value and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field}={value!r} is invalid: an integer >= 0 (0: off; else the fewest rows of a "
                         "step whose layers run sequence-parallel)")
    return value


def sequence_parallel_from(size: int, min_rows: int) -> int:
    """The fewest rows of a sequence-parallel step at `size` ranks (0: none is): the engine's token
    buckets stop below it (engine/device/cuda_graph.py `graph_token_sizes`, `eager_from`)."""
    return min_rows if size > 1 else 0


def takes_sequence_parallel(size: int, min_rows: int, rows: int, graph_sizes: Sequence[int] = ()) -> bool:
    """Whether a forward of `rows` rows runs sequence-parallel (every rank decides alike). A step
    that replays a CUDA graph, one of at most the largest of the `graph_sizes` its kind captured
    (decode-only batches: batch sizes; steps with prefill: token sizes; ascending), keeps the
    all-reduces: captures run the all-reduce path."""
    if graph_sizes and rows <= graph_sizes[-1]:
        return False
    return size > 1 and 0 < min_rows <= rows


def padded_rows(rows: int, size: int) -> int:
    """A sequence-parallel step's rows, padded to a multiple of the `size` ranks."""
    return -(-rows // size) * size
