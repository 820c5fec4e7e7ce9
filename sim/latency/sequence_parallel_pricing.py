"""The price of a sequence-parallel step (the engine's `parallel.sequence_parallel_min_rows`,
engine/models/sequence_parallel.py) in the operator model (sim/latency/operators.py).

An eager step of T >= `min_rows` tokens at N > 1 GPUs runs its layers on T' = ceil(T / N) N rows
(padded with zero rows), each rank holding T' / N of them between the layer boundaries. Its
layer stack, every part that depends on the rows only, costs

    embedding(T') + reduce_scatter(T' h b)              the embedding's sums, to each rank's rows
    + L x [ agmm(T', h, (Hq + 2 Hkv) D) + mmrs(T', Hq D, h) + agmm(T', h, 2 I) + mmrs(T', I, h)
            + 2 add_rms_norm(T' / N, h) + qk_rope_write(T) + silu_and_mul(T', I) ]
    + add_rms_norm(T' / N, h) + all_gather(T' h b)      the final norm on each rank's rows, gathered

with this GPU's shard widths (as `OperatorModel`'s), and no all-reduce. The boundaries run as
the engine's group runs them: where it has symmetric memory (the run's all-reduce not off),
torch's fused ops, `agmm` = `all_gather_matmul` and `mmrs` = `matmul_reduce_scatter` rows, each
GEMM overlapped with its collective; without, the collective and the GEMM one after the other:
agmm = all_gather(T' k b) + gemm(T', k, n) and mmrs = gemm(T', k, n) + reduce_scatter(T' n b).
Attention, the LM head and sampling are priced as for any step (the engine runs them alike).
Such a step is never replayed from a CUDA graph: the engine's token buckets stop below
`min_rows` (engine/device/cuda_graph.py `graph_token_sizes`, `eager_from`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sim.latency.op_grid import OpGrid
from sim.latency.operator_file import SEQUENCE_PARALLEL_OPS
from sim.latency.operator_profile import OperatorProfile
from sim.latency.shapes import ModelShape

# Breakdown families (experiments/lab/operator_breakdown.py) this step's parts are booked under.
FUSED_FAMILY = "gemm + row collectives"
ROW_COLLECTIVES = "row collectives"
GEMM_FAMILY = "gemm"
ELEMENTWISE = "norms, activation, rope, embedding"
TAKE_ROWS = ("python -m experiments.profile mode=operators operator_parts=[collectives] on N GPUs "
             "(operator_grid.sequence_parallel_m lists the step rows timed)")


def check_min_rows(value: object) -> int:
    """`parallel.sequence_parallel_min_rows` as the engine validates it (engine/parallel_config.py)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"parallel.sequence_parallel_min_rows={value!r} is invalid: an integer >= 0 (0: off; else "
                         "the fewest rows of a step whose layers run sequence-parallel)")
    return value


@dataclass(slots=True)
class SequenceParallelPricing:
    """A sequence-parallel step's layer stack at `size` GPUs, by family (`parts`)."""

    size: int
    min_rows: int
    layers: int
    token_bytes: int  # one row of the residual stream: hidden x dtype bytes
    dtype_bytes: int
    fused: bool  # the engine's group has torch's fused ops (symmetric memory on)
    boundaries: list[tuple[str, int, int]]  # (op kind, k, n) of a layer's four GEMMs, in order
    gemm: OpGrid
    gather_mm: Callable[[float, float, float], float] | None
    mm_scatter: Callable[[float, float, float], float] | None
    reduce_scatter: OpGrid
    all_gather: OpGrid
    add_rms_norm: OpGrid  # over m, at the hidden width
    silu_and_mul: OpGrid  # over m, at the shard's intermediate width
    qk_rope_write: OpGrid  # over m, at the shard's heads
    embedding: OpGrid  # over m, at the hidden width

    @classmethod
    def of(cls, profile: OperatorProfile, model: ModelShape, size: int, min_rows: int, fused: bool,
           elementwise: dict[str, OpGrid]) -> SequenceParallelPricing:
        """`model`: one GPU's shard (`shard_shape`); `fused`: whether the engine's group has symmetric
        memory (then the fused rows are needed); `elementwise`: the model's own one-axis grids
        (`add_rms_norm`, `silu_and_mul`, `qk_rope_write`, `embedding`). Raises ValueError naming the
        rows a profile lacks and how to take them."""
        needed = [*(SEQUENCE_PARALLEL_OPS if fused else ()), "reduce_scatter", "all_gather"]
        missing = [op for op in dict.fromkeys(needed) if not profile.has(op, size)]
        if missing:
            how = "torch's fused symmetric-memory ops" if fused else "plain collectives (symmetric memory off)"
            raise ValueError(f"parallel.sequence_parallel_min_rows={min_rows}: operator profile "
                             f"{[str(p) for p in profile.paths]} lacks {missing} at N={size}, which price the "
                             f"sequence-parallel steps ({how}); take them with {TAKE_ROWS}, or set it to 0")
        h, d = model.hidden_size, model.head_dim
        q = model.num_attention_heads * d
        boundaries = [("gather", h, q + 2 * model.num_key_value_heads * d), ("scatter", q, h),
                      ("gather", h, 2 * model.intermediate_size), ("scatter", model.intermediate_size, h)]
        grid = (lambda op: profile.grid(op, size)) if fused else None
        return cls(size, min_rows, model.num_hidden_layers, h * model.dtype_bytes, model.dtype_bytes, fused,
                   boundaries, profile.grid("gemm"),
                   grid("all_gather_matmul") if grid else None, grid("matmul_reduce_scatter") if grid else None,
                   profile.grid("reduce_scatter", size), profile.grid("all_gather", size), **elementwise)

    def takes(self, tokens: int) -> bool:
        """Whether the engine runs a step of `tokens` tokens sequence-parallel (`TPGroup.takes_sequence_parallel`)."""
        return self.size > 1 and 0 < self.min_rows <= tokens

    def padded_rows(self, tokens: int) -> int:
        return -(-tokens // self.size) * self.size

    def parts(self, tokens: int) -> dict[str, float]:
        """Seconds of the layer stack of a step of `tokens` tokens, by breakdown family."""
        rows = self.padded_rows(tokens)
        L, own = self.layers, rows // self.size
        boundary = collectives = gemm = 0.0
        for kind, k, n in self.boundaries:
            if self.fused:
                op = self.gather_mm if kind == "gather" else self.mm_scatter
                boundary += op(rows, k, n)
            else:
                gemm += self.gemm(rows, k, n)
                collectives += (self.all_gather(rows * k * self.dtype_bytes) if kind == "gather"
                                else self.reduce_scatter(rows * n * self.dtype_bytes))
        elementwise = ((2 * L + 1) * self.add_rms_norm(own) + L * (self.silu_and_mul(rows) + self.qk_rope_write(tokens))
                       + self.embedding(rows))
        ends = self.reduce_scatter(rows * self.token_bytes) + self.all_gather(rows * self.token_bytes)
        return {FUSED_FAMILY: L * boundary, GEMM_FAMILY: L * gemm, ROW_COLLECTIVES: L * collectives + ends,
                ELEMENTWISE: elementwise}
