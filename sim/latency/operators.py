"""Latency model composed from operator timings (`experiments/profiles/operators/`, schema in
sim/latency/operator_file.py): any model's step on a GPU whose operators were profiled, at any
tensor-parallel size whose collectives were (or, with `latency.collectives=measured_else_ring`, at
any size, the unmeasured ones priced from the interconnect: sim/latency/collective_pricing.py).

One GPU's share of the model (`shard_shape`: its heads, MLP columns, vocabulary rows) runs, for
a step of T tokens (prefill + decodes), R sampled rows, B decodes reading C KV entries in all:

    launch                                  graph_launch (m = 1): launch and wait
    + embedding(T, h) + add_rms_norm(T, h)  once (the final norm)
    + L x [ gemm(T, h, (Hq + 2 Hkv) D) + gemm(T, Hq D, h) + gemm(T, h, 2 I) + gemm(T, I, h)
            + 2 add_rms_norm(T, h) + qk_rope_write(T) + silu_and_mul(T, I)
            + decode_attention(B, C / B) + sum over prefill chunks of prefill_attention(q, c) ]
    + gemm(G, h, V) + sampler(R, V)         the LM head on the graph's sample rows, then sampling
                                            (V: the shard's vocabulary rows, V_full / N padded)
    + (2 L + 1) all_reduce(T h b) + all_gather(8 N R)   at N > 1 GPUs (the all-reduce on the
                                            engine's path for T h b bytes: collective_pricing.py;
                                            the sampler's fast path draws from each rank's columns
                                            and exchanges one 8-byte pair per row and rank:
                                            engine/distributed/vocab_parallel_sampling.py)
    where the engine fuses its layer boundaries (`all_reduce_kernel` "triton_fused", or
    "triton_lamport", the default at two GPUs, priced from its own rows), 2 L of them (each
    layer's post-attention norm, the next layer's input norm, the final norm: all but the
    embedding's all-reduce and the first input norm) cost all_reduce_add_rms_norm(T h b) in
    place of all_reduce(T h b) + add_rms_norm(T, h), except at the message sizes the engine
    falls back on (collective_pricing.py `price_fused_boundary`)
    + copy_blocks(copies x block bytes) + host_step_s
    + sync_host_s + sync_host_per_seq_s x sequences   (a step not scheduled ahead)

An eager step the engine runs sequence-parallel (`parallel.sequence_parallel_min_rows`) has the
layer stack sim/latency/sequence_parallel_pricing.py prices in place of the token terms and the
all-reduces above.

The host's per-step work (scheduling, input preparation, output processing) overlaps the GPU's in
a step scheduled ahead (async scheduling); a step that was not (`SchedulerOutput.ahead` false, or
every step with `async_scheduling` off) waits for it: `sync_host_s` plus `sync_host_per_seq_s` per
scheduled sequence, host costs that do not depend on the model.

Decode attention is measured on batches of equal contexts; a ragged batch, and one launched at a
CUDA graph's rows, is priced as sim/latency/decode_attention_pricing.py says.

With the engine's CUDA-graph sizes given (`batch_sizes` for decode-only steps, `token_sizes` for
steps with prefill: engine/device/cuda_graph.py), T is padded to the graph a step runs, as the engine's
linear layers, norms and all-reduces compute the padding rows (attention and sampling skip them),
and the LM head (with its all-gather) runs on the graph's G sample rows: the batch size of a decode
graph, min(T, max_num_seqs) of a token graph (G = R in an eager step).
Prefill chunks run in one kernel launch: their times add above the smallest prefill time (the
launch-bound floor), which is paid once. Everything that depends only on T is summed once at
construction on the union of the grids' token points (`token_curve`), so a step costs a few
interpolations. Swaps: the mean of swap_out and swap_in at n x block bytes.

A step's price from the terms built here, by operator family where asked:
sim/latency/operator_step_price.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from policies.outputs import SchedulerOutput
from sim.latency.base import BatchShape, LatencyModel, shape_decode_times
from sim.latency.build import LATENCY_MODELS, EngineAllReduce, LatencyConfig, LatencySetup
from sim.latency.collective_pricing import (
    check_mode,
    price_collectives,
    price_engine_all_reduce,
    price_fused_boundary,
)
from sim.latency.decode_attention_pricing import DecodeAttentionPricing
from sim.latency.file_meta import check_device
from sim.latency.op_grid import Axis, OpGrid
from sim.latency.operator_profile import OperatorProfile, find_operator_files
from sim.latency.operator_step_price import OperatorStepPrice
from sim.latency.sequence_parallel_pricing import ELEMENTWISE, GEMM_FAMILY, SequenceParallelPricing
from sim.latency.shapes import Hardware, ModelShape
from sim.latency.tensor_parallel import SAMPLED_PAIR_BYTES, shard_shape

REQUIRED = ("gemm", "decode_attention", "prefill_attention", "qk_rope_write", "add_rms_norm", "silu_and_mul",
            "embedding", "sampler", "graph_launch")


def summed(axis_name: str, points: list[float], parts: list[tuple[float, OpGrid]]) -> OpGrid:
    """sum(weight x grid(x)) of one-axis grids, as one grid on `points`."""
    values = [sum(w * g(x) for w, g in parts) for x in points]
    return OpGrid((Axis(axis_name, tuple(points)),), np.array(values))


@dataclass(kw_only=True)
class OperatorsConfig(LatencyConfig):
    """conf/latency/operators.yaml (its comments say what each key means)."""

    dir: str | None = None  # the operator files' directory (a caller resolves a relative one)
    gpu: str | None = None
    dtype: str | None = None
    kernels: str = "auto"
    cuda_graphs: bool = True
    host_step_s: float = 0.0
    sync_host_s: float = 0.0
    sync_host_per_seq_s: float = 0.0
    decode_wave_programs: int = 0
    admission_s: float = 0.0
    collectives: str = "measured"  # sim/latency/collective_pricing.py: COLLECTIVE_MODES


@LATENCY_MODELS.register("operators", config=OperatorsConfig)
class OperatorModel(OperatorStepPrice, LatencyModel):
    name = "operators"
    prices_sequence_parallel = True

    @classmethod
    def from_config(cls, config: OperatorsConfig, setup: LatencySetup) -> OperatorModel:
        """The operator files of `config.gpu` and `config.dtype` in `config.dir`; with `cuda_graphs`,
        steps priced at the engine's graph buckets (`setup.graph_sizes`)."""
        files = find_operator_files(Path(str(config.dir)), str(config.gpu), str(config.dtype), str(config.kernels))
        batch_sizes, token_sizes = (setup.graph_sizes() if config.cuda_graphs and setup.graph_sizes is not None
                                    else (None, None))
        engine_paths = (setup.all_reduce() if setup.all_reduce is not None and setup.tensor_parallel_size > 1
                        else None)
        profile = OperatorProfile.load(files)
        for path, meta in zip(profile.paths, profile.meta):
            check_device(f"operator profile {str(path)!r} (latency.gpu={config.gpu!r})", meta.get("device"),
                         setup.hardware.name)
        return cls(profile, setup.model, setup.block_size, setup.tensor_parallel_size,
                   host_step_s=config.host_step_s, admission_s=config.admission_s, batch_sizes=batch_sizes,
                   token_sizes=token_sizes, sync_host_s=config.sync_host_s,
                   sync_host_per_seq_s=config.sync_host_per_seq_s, async_scheduling=setup.async_scheduling,
                   decode_wave_programs=config.decode_wave_programs, decode_splits=setup.decode_splits,
                   max_model_len=setup.max_model_len, kv_reread_cost=setup.hardware.kv_reread_cost,
                   collectives=config.collectives, hardware=setup.hardware, engine_all_reduce=engine_paths,
                   sequence_parallel_min_rows=setup.sequence_parallel_min_rows)

    def __init__(self, profile: OperatorProfile, model: ModelShape, block_size: int,
                 tensor_parallel_size: int = 1, host_step_s: float = 0.0, admission_s: float = 0.0,
                 batch_sizes: list[int] | None = None, token_sizes: list[int] | None = None,
                 sync_host_s: float = 0.0, sync_host_per_seq_s: float = 0.0, async_scheduling: bool = True,
                 decode_wave_programs: int = 0, decode_splits: Callable[[int, int, int], int] | None = None,
                 max_model_len: int | None = None, kv_reread_cost: float = 1.0, collectives: str = "measured",
                 hardware: Hardware | None = None, engine_all_reduce: EngineAllReduce | None = None,
                 sequence_parallel_min_rows: int = 0) -> None:
        """`kv_reread_cost` (`Hardware.kv_reread_cost`): decode attention is profiled on distinct KV,
        so a batch's shared KV entries count as that fraction of a distinct one's (`decode_context`).
        `collectives` (COLLECTIVE_MODES) and the run's `hardware`: how collectives at a world size
        the profile did not measure are priced (sim/latency/collective_pricing.py);
        `engine_all_reduce`: the paths the engine takes for each all-reduce (None: priced as NCCL's).
        `sequence_parallel_min_rows` (> 0 at N > 1): eager steps of that many tokens or more run
        sequence-parallel (sim/latency/sequence_parallel_pricing.py)."""
        missing = [op for op in REQUIRED if not profile.has(op)]
        if missing:
            raise ValueError(f"operator profile {[str(p) for p in profile.paths]} lacks op {missing}: take the "
                             "compute part (python -m experiments.profile mode=operators operator_parts=[compute])")
        tp = tensor_parallel_size
        check_mode(collectives)
        comm = price_collectives(profile, tp, collectives, hardware) if tp > 1 else None
        for name, value in (("host_step_s", host_step_s), ("admission_s", admission_s), ("sync_host_s", sync_host_s),
                            ("sync_host_per_seq_s", sync_host_per_seq_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"latency.{name}={value!r} is invalid: must be a number >= 0 (seconds)")
        if isinstance(decode_wave_programs, bool) or not isinstance(decode_wave_programs, int) or decode_wave_programs < 0:
            raise ValueError(f"latency.decode_wave_programs={decode_wave_programs!r} is invalid: must be an integer >= 0 "
                             "(programs of one wave of the decode kernel; 0: price decodes at the mean context)")
        self.set_reread_cost(kv_reread_cost, block_size)
        self.decode_wave_programs = decode_wave_programs
        self.uses_longest_context = decode_wave_programs > 0
        self.profile, self.tensor_parallel_size = profile, tp
        self.batch_sizes, self.token_sizes = list(batch_sizes or []), list(token_sizes or [])
        self.host_step_s, self.admission_s = float(host_step_s), float(admission_s)
        self.sync_host_s, self.sync_host_per_seq_s = float(sync_host_s), float(sync_host_per_seq_s)
        self.async_scheduling = async_scheduling
        m = shard_shape(model, tp)
        self.model = m
        h, d, b = m.hidden_size, m.head_dim, m.dtype_bytes
        group = m.num_attention_heads / m.num_key_value_heads
        gemm = profile.grid("gemm")
        layer_gemms = [(h, (m.num_attention_heads + 2 * m.num_key_value_heads) * d), (m.num_attention_heads * d, h),
                       (h, 2 * m.intermediate_size), (m.intermediate_size, h)]
        width = {"head_dim": d, "num_kv_heads": m.num_key_value_heads, "group": group}
        L = m.num_hidden_layers
        self.all_reduce = self.all_gather = self.fused_boundary = None
        self.sources = {"compute": f"measured ({', '.join(profile.files('gemm'))})"}
        if comm is not None:
            self.all_reduce, all_reduce_source = price_engine_all_reduce(profile, tp, comm, engine_all_reduce)
            self.all_gather = comm.all_gather
            self.fused_boundary, fused_source = price_fused_boundary(profile, tp, comm, engine_all_reduce, h)
            self.sources["collectives"] = "; ".join(x for x in (comm.source, all_reduce_source, fused_source) if x)
        # The boundaries priced fused: their norms are priced per step (`shape_time`), with the
        # all-reduces, as the message's size decides whether the engine fuses them.
        self.fused_count = 2 * L if self.fused_boundary is not None else 0
        self.add_rms_norm = profile.grid("add_rms_norm").fix("n", h)
        elementwise = {"add_rms_norm": self.add_rms_norm,  # each over m, at this model's widths
                       "silu_and_mul": profile.grid("silu_and_mul").fix("n", m.intermediate_size),
                       "qk_rope_write": profile.grid("qk_rope_write").fixed(**width),
                       "embedding": profile.grid("embedding").fix("n", h)}
        counts = {"add_rms_norm": 2.0 * L + 1 - self.fused_count, "silu_and_mul": float(L),
                  "qk_rope_write": float(L), "embedding": 1.0}
        families = {GEMM_FAMILY: [(float(L), gemm.fixed(k=k, n=n)) for k, n in layer_gemms],
                    ELEMENTWISE: [(counts[op], g) for op, g in elementwise.items()]}
        parts = [part for family in families.values() for part in family]
        points = sorted({p for _, g in parts for p in g.axes[0].points})
        self.token_curve = summed("m", points, parts)
        # The same curve by operator family, for `shape_time(..., parts)` (a breakdown, not the hot path).
        self.token_families = {name: summed("m", points, family) for name, family in families.items()}
        self.sequence_parallel = SequenceParallelPricing.for_run(profile, m, tp, sequence_parallel_min_rows,
                                                                 engine_all_reduce, elementwise)
        if self.sequence_parallel is not None:
            self.sources["sequence parallel"] = self.sequence_parallel.source
        self.lm_head = gemm.fixed(k=h, n=m.vocab_size)
        self.sampler = profile.grid("sampler").fix("n", m.vocab_size)  # each rank draws from its columns
        self.decode_pricing = DecodeAttentionPricing(profile, width, m.num_key_value_heads, decode_wave_programs,
                                                     decode_splits, max_model_len, block_size, self.kv_reread_cost)
        self.prefill = profile.grid("prefill_attention").fixed(**width)
        self.prefill_floor = self.prefill.min_time
        self.launch_s = profile.grid("graph_launch")(1)
        self.token_bytes = h * b
        self.pair_bytes = SAMPLED_PAIR_BYTES * tp  # every rank's (best score, column) of one sampled row
        self.block_bytes = m.kv_bytes_per_token * block_size
        self.copy = profile.grid("copy_blocks") if profile.has("copy_blocks") else None
        self.swaps = [profile.grid(op) for op in ("swap_out", "swap_in") if profile.has(op)]

    def data_sources(self) -> dict[str, str]:
        return dict(self.sources)

    def step_time(self, out: SchedulerOutput) -> float:
        shape = BatchShape.of(out, self.uses_longest_context, self._shared_block_size)
        if not out.scheduled:
            return self.shape_time(shape)
        waits = not (self.async_scheduling and out.ahead)
        return self.shape_time(shape) + (self.sync_host(len(out.scheduled)) if waits else 0.0)

    def sync_host(self, num_seqs: int) -> float:
        """Host seconds of a step of `num_seqs` sequences that was not scheduled ahead."""
        return self.sync_host_s + self.sync_host_per_seq_s * num_seqs

    def decode_times(self, num_seqs: int, num_context_tokens: int, num_samples: int,
                     num_steps: int, max_context_tokens: int = 0,
                     num_shared_context_tokens: int = 0) -> list[float]:
        """A fast-forward runs from a step scheduled ahead (async scheduling), else every step waits
        for the host (sim/simulator.py)."""
        times = shape_decode_times(self.shape_time, num_seqs, num_context_tokens, num_samples, num_steps,
                                   max_context_tokens, num_shared_context_tokens)
        if self.async_scheduling:
            return times
        host = self.sync_host(num_seqs)
        return [t + host for t in times]

    def swap_time(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        if not self.swaps:
            raise ValueError(f"operator profile {[str(p) for p in self.profile.paths]} lacks ops swap_out/swap_in: "
                             "a run that swaps needs them")
        nbytes = num_blocks * self.block_bytes
        return sum(g(nbytes) for g in self.swaps) / len(self.swaps)
