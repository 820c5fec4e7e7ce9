"""The price of a sequence-parallel step (the engine's `parallel.sequence_parallel_min_rows`,
engine/models/sequence_parallel.py; which steps and how many rows: policies/sequence_parallel.py)
in the operator model (sim/latency/operators.py).

An eager step of T >= `min_rows` tokens at N > 1 GPUs runs its layers on T' = ceil(T / N) N rows
(padded with zero rows), each rank holding T' / N of them between the layer boundaries. Its
layer stack, every part that depends on the rows only, costs

    embedding(T') + reduce_scatter(T' h b)              the embedding's sums, to each rank's rows
    + L x [ agmm(T', h, (Hq + 2 Hkv) D) + mmrs(T', Hq D, h) + agmm(T', h, 2 I) + mmrs(T', I, h)
            + 2 add_rms_norm(T' / N, h) + qk_rope_write(T) + silu_and_mul(T', I) ]
    + add_rms_norm(T' / N, h) + all_gather(T' h b)      the final norm on each rank's rows, gathered

with this GPU's shard widths (as `OperatorModel`'s), and no all-reduce. The boundaries run as
the engine's group runs them: where it maps its peers' memory (the settings leave the symmetric
paths on, `EngineAllReduce.symmetric_memory`), torch's fused ops, `agmm` = `all_gather_matmul` and
`mmrs` = `matmul_reduce_scatter` rows, each GEMM overlapped with its collective; without, the
collective and the GEMM one after the other: agmm = all_gather(T' k b) + gemm(T', k, n) and mmrs =
gemm(T', k, n) + reduce_scatter(T' n b) (the collectives' rows are timed in CUDA graphs, which the
engine's eager steps are not: at these MB sizes the launch is a small share). The fused rows must
have been taken with the fused ops (the file's `sequence_parallel_ops` metadata, where recorded)
and reach down to the setting's rows: below their smallest m a grid would price every step at it.
Attention, the LM head and sampling are priced as for any step (the engine runs them alike). Not
priced: the copy that pads attention's output to T' rows when N does not divide T, and Qwen2's bias
adds; the first layer's input norm (a plain RMSNorm in the engine) is priced as `add_rms_norm`, as
the all-reduce path's is (sim/latency/operators.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from policies.sequence_parallel import check_min_rows, padded_rows, takes_sequence_parallel
from sim.latency.build import EngineAllReduce
from sim.latency.op_grid import OpGrid
from sim.latency.operator_file import SEQUENCE_PARALLEL_META
from sim.latency.operator_profile import OperatorProfile
from sim.latency.shapes import ModelShape

# Breakdown families (experiments/lab/operator_breakdown.py): the last two are every step's
# (sim/latency/operators.py), the first two a sequence-parallel step's own.
FUSED_FAMILY = "gemm + row collectives"
ROW_COLLECTIVES = "row collectives"
GEMM_FAMILY = "gemm"
ELEMENTWISE = "norms, activation, rope, embedding"
FIELD = "parallel.sequence_parallel_min_rows"
IMPLEMENTATIONS = ("fused", "plain")  # the profile's `sequence_parallel_ops` values
TAKE_ROWS = ("python -m experiments.profile mode=operators operator_parts=[collectives] on N GPUs "
             "(operator_grid.sequence_parallel_m lists the step rows timed)")
Call = tuple[str, float, float, float]  # (op, m, k, n) of a GEMM-like op; (op, bytes, 0, 0) of a collective


@dataclass(slots=True)
class SequenceParallelPricing:
    """A sequence-parallel step's layer stack at `size` GPUs: its calls (`calls`) and their
    seconds by family (`parts`)."""

    size: int
    min_rows: int
    layers: int
    token_bytes: int  # one row of the residual stream: hidden x dtype bytes
    dtype_bytes: int
    fused: bool  # the engine's group has torch's fused ops
    boundaries: list[tuple[str, int, int]]  # (op, k, n) of a layer's four GEMMs, in order
    grids: dict[str, Callable[..., float]]  # op -> seconds (GEMM-like: (m, k, n); collectives: (bytes,))
    source: str = ""  # what the price rests on, for `data_sources`

    @classmethod
    def for_run(cls, profile: OperatorProfile, model: ModelShape, size: int, min_rows: object,
                engine: EngineAllReduce | None,
                elementwise: dict[str, OpGrid]) -> SequenceParallelPricing | None:
        """None at one GPU or with the setting off. `model`: one GPU's shard (`shard_shape`);
        `engine`: the run's all-reduce (None: not known, the boundaries priced as plain
        collectives); `elementwise`: the model's one-axis grids over m (`add_rms_norm`,
        `silu_and_mul`, `qk_rope_write`, `embedding`). Raises ValueError naming the rows a profile
        lacks or does not cover, and how to take them."""
        min_rows = check_min_rows(min_rows, FIELD)
        if size == 1 or min_rows == 0:
            return None
        fused = engine is not None and engine.symmetric_memory
        ops = ("all_gather_matmul", "matmul_reduce_scatter") if fused else ("gemm",)
        missing = [op for op in (*ops, "reduce_scatter", "all_gather")
                   if not profile.has(op, 1 if op == "gemm" else size)]
        how = ("torch's fused symmetric-memory ops: all_gather_matmul / matmul_reduce_scatter rows"
               if fused else
               "all_gather / reduce_scatter rows beside the GEMMs "
               + ("(symmetric memory off)" if engine is not None else "(the engine's paths not known)"))
        if missing:
            raise ValueError(f"{FIELD}={min_rows}: operator profile {[str(p) for p in profile.paths]} "
                             f"lacks {missing} at N={size}, which price the sequence-parallel steps ({how}); "
                             f"take them with {TAKE_ROWS}, or set it to 0")
        grids: dict[str, Callable[..., float]] = {**elementwise, "gemm": profile.grid("gemm"),
                                                  "reduce_scatter": profile.grid("reduce_scatter", size),
                                                  "all_gather": profile.grid("all_gather", size)}
        files, unsaid = profile.files("reduce_scatter", size), False
        if fused:
            first = padded_rows(min_rows, size)  # the fewest rows a sequence-parallel step has
            for op in ops:
                grids[op] = profile.grid(op, size)
                smallest = grids[op].axes[0].points[0]
                if first < smallest:
                    raise ValueError(f"{FIELD}={min_rows} is invalid with this profile: its {op} rows "
                                     f"at N={size} start at m={smallest:g} rows, above the setting's steps; "
                                     f"take rows from {first} ({TAKE_ROWS}), or set it to {smallest:g} "
                                     "or more")
            files = list(dict.fromkeys(f for op in ops for f in profile.files(op, size)))
            said = {name: _recorded_ops(profile, name, size) for name in files}
            for name, recorded in said.items():
                if recorded == "plain":
                    raise ValueError(f"{FIELD}={min_rows}: the boundary rows at N={size} ({name}) timed the "
                                     f"plain implementation, and the engine would run {how}: take them where "
                                     "the GPUs map each other's memory, or price the plain path with "
                                     "parallel.disable_custom_all_reduce=true, or set it to 0")
            unsaid = None in said.values()
        rows_from = ", ".join(files) + ("; their implementation not recorded" if unsaid else "")
        pricing = cls.layout(model, size, min_rows, fused)
        pricing.grids, pricing.source = grids, f"steps of {min_rows}+ tokens (eager): {how} ({rows_from})"
        return pricing

    @classmethod
    def layout(cls, model: ModelShape, size: int, min_rows: int, fused: bool) -> SequenceParallelPricing:
        """The step's calls for one GPU's shard `model`, without their prices (`calls` only)."""
        h, d = model.hidden_size, model.head_dim
        q = model.num_attention_heads * d
        boundaries = [("all_gather_matmul", h, q + 2 * model.num_key_value_heads * d),
                      ("matmul_reduce_scatter", q, h), ("all_gather_matmul", h, 2 * model.intermediate_size),
                      ("matmul_reduce_scatter", model.intermediate_size, h)]
        return cls(size, min_rows, model.num_hidden_layers, h * model.dtype_bytes, model.dtype_bytes, fused,
                   boundaries, {})

    def takes(self, tokens: int, graph_sizes: Sequence[int]) -> bool:
        """Whether the engine runs a step of `tokens` tokens sequence-parallel; `graph_sizes`: the
        CUDA-graph sizes of the step's kind (a step that replays one does not)."""
        return takes_sequence_parallel(self.size, self.min_rows, tokens, graph_sizes)

    def calls(self, tokens: int) -> list[Call]:
        """Every row-dependent call of the step, in the engine's order (engine/models/
        sequence_parallel.py): what `parts` sums. Each layer: its input norm, q/k/v, q/k norm + rope
        + KV write on the T real rows, o_proj, the post-attention norm, gate/up, SiLU, down."""
        rows = padded_rows(tokens, self.size)
        own, b = rows // self.size, self.dtype_bytes

        def boundary(op: str, k: int, n: int) -> list[Call]:
            if self.fused:
                return [(op, rows, k, n)]
            if op == "all_gather_matmul":
                return [("all_gather", rows * k * b, 0, 0), ("gemm", rows, k, n)]
            return [("gemm", rows, k, n), ("reduce_scatter", rows * n * b, 0, 0)]
        qkv, o, gate_up, down = (boundary(*x) for x in self.boundaries)
        norm: list[Call] = [("add_rms_norm", own, 0, 0)]
        layer = (norm + qkv + [("qk_rope_write", tokens, 0, 0)] + o + norm + gate_up
                 + [("silu_and_mul", rows, 0, 0)] + down)
        ends = [("embedding", rows, 0, 0), ("reduce_scatter", rows * self.token_bytes, 0, 0)]
        return ends + layer * self.layers + norm + [("all_gather", rows * self.token_bytes, 0, 0)]

    def parts(self, tokens: int) -> dict[str, float]:
        """Seconds of the layer stack of a step of `tokens` tokens, by breakdown family."""
        families = dict.fromkeys((FUSED_FAMILY, GEMM_FAMILY, ROW_COLLECTIVES, ELEMENTWISE), 0.0)
        seen: dict[Call, float] = {}
        for call in self.calls(tokens):
            t = seen.get(call)
            if t is None:
                op, x, k, n = call
                t = seen[call] = self.grids[op](x, k, n) if k else self.grids[op](x)
            families[_family(call[0])] += t
        return {name: t for name, t in families.items() if t}


def _family(op: str) -> str:
    if op in ("all_gather_matmul", "matmul_reduce_scatter"):
        return FUSED_FAMILY
    if op == "gemm":
        return GEMM_FAMILY
    return ROW_COLLECTIVES if op in ("reduce_scatter", "all_gather") else ELEMENTWISE


def _recorded_ops(profile: OperatorProfile, name: str, size: int) -> str | None:
    """The implementation a file says its boundary rows at `size` timed ("fused", "plain"), None
    where it does not say."""
    for path, meta in zip(profile.paths, profile.meta, strict=True):
        if path.name == name and SEQUENCE_PARALLEL_META in meta:
            value = meta[SEQUENCE_PARALLEL_META]
            try:
                said = json.loads(value)
                ok = isinstance(said, dict) and all(v in IMPLEMENTATIONS for v in said.values())
            except json.JSONDecodeError:
                ok = False
            if not ok:
                raise ValueError(f"{path}: metadata {SEQUENCE_PARALLEL_META}={value!r} is invalid: a JSON "
                                 "object of world size -> 'fused' or 'plain'")
            return said.get(str(size))
    return None
