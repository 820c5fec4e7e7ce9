"""The roofline's price of a sequence-parallel step (the engine's `parallel.sequence_parallel_min_rows`,
engine/models/sequence_parallel.py; which steps and how many rows: policies/sequence_parallel.py),
in the ring model of sim/latency/tensor_parallel.py.

A step of T >= `min_rows` tokens at N > 1 GPUs runs its layers on T' = ceil(T / N) N rows, each
rank holding T' / N of them between the layer boundaries. The boundaries move the bytes of the
all-reduce path's 2 L + 1 all-reduces, each split in two: the embedding's sums are reduce-scattered
to each rank's rows, every layer all-gathers the q/k/v and gate/up GEMMs' inputs and
reduce-scatters the o_proj and down GEMMs' outputs, and the final norm's rows are all-gathered:
4 L + 2 collectives of c = a + (N - 1) / N * T' h b / B each. The residual adds and norms (the 8 h
term of `ModelShape.activation_bytes_per_token`: two add + RMSNorm per layer) run on each rank's
T' / N rows; every other term of the step is priced as any step's, on T' rows.

Where the engine's group maps its peers' memory (`EngineAllReduce.symmetric_memory`), each GEMM
boundary is one of torch's fused ops, its collective overlapped with its GEMM, and only the part of
c beyond that GEMM's time (the step's GEMM time shared out by parameters) is priced. Without it,
or where the engine's paths are not known, every collective follows its GEMM and costs c whole.
Steps the engine replays from a CUDA graph (with the graph sizes given: the engine's default
buckets, `enforce_eager` not known here) run the all-reduce path whatever their size.
"""
from __future__ import annotations

from dataclasses import dataclass

from policies.model_shape import ModelShape
from policies.sequence_parallel import check_min_rows, padded_rows, takes_sequence_parallel
from sim.latency.build import LatencySetup
from sim.latency.tensor_parallel import SAMPLED_PAIR_BYTES, RingLink

NORM_ELEMENTS_PER_LAYER = 8  # x hidden: two add + RMSNorm per layer, each reading and writing 2 h


@dataclass(slots=True, frozen=True)
class SequenceParallelRoofline:
    """What a sequence-parallel step changes in the roofline's price on one GPU's shard: its rows,
    its elementwise traffic and its boundaries' collectives in place of the all-reduces."""

    min_rows: int
    fused: bool  # the boundaries overlap their GEMMs (torch's fused symmetric-memory ops)
    batch_sizes: tuple[int, ...]  # the engine's CUDA-graph sizes for decode-only batches (none known: ())
    token_sizes: tuple[int, ...]  # and for steps with prefill tokens
    layers: int  # the shard's decoder layers: the per-step totals below sum over them
    link: RingLink  # the ring over the run's GPUs (`link.size` of them)
    row_bytes: int  # one row of the residual stream: hidden x dtype bytes
    linear_weights_s: float  # reading every layer's GEMM weights once
    linear_s_per_row: float  # every layer's GEMM FLOPs for one row
    norm_s_per_row: float  # the residual adds and norms of one row, all layers
    other_elementwise_s_per_row: float  # the rest of `activation_bytes_per_token`, one row
    boundary_shares: tuple[float, ...]  # a layer's four GEMMs' shares of its parameters

    @classmethod
    def for_run(cls, setup: LatencySetup, shard: ModelShape, *, bandwidth: float,
                gemm_s_per_token: float) -> SequenceParallelRoofline | None:
        """None at one GPU or with the setting off. `shard`: one GPU's model (`shard_shape`);
        `bandwidth`: the HBM bytes/s the roofline prices at; `gemm_s_per_token`: the roofline's
        seconds of every layer's GEMM FLOPs for one row."""
        min_rows = check_min_rows(setup.sequence_parallel_min_rows, "parallel.sequence_parallel_min_rows")
        if setup.tensor_parallel_size == 1 or min_rows == 0:
            return None
        fused = setup.all_reduce is not None and setup.all_reduce().symmetric_memory
        batches, tokens = setup.graph_sizes() if setup.graph_sizes is not None else ([], [])
        h, b = shard.hidden_size, shard.dtype_bytes
        per_layer, gemms = shard.linear_params_per_layer, shard.gemm_params_per_layer
        norm_bytes = shard.num_hidden_layers * NORM_ELEMENTS_PER_LAYER * h * b
        return cls(min_rows, fused, tuple(batches), tuple(tokens), shard.num_hidden_layers,
                   RingLink.of(setup.hardware, setup.tensor_parallel_size), h * b,
                   shard.linear_params * b / bandwidth, gemm_s_per_token, norm_bytes / bandwidth,
                   (shard.activation_bytes_per_token - norm_bytes) / bandwidth, tuple(p / per_layer for p in gemms))

    def takes(self, tokens: int, decode_only: bool) -> bool:
        """Whether the engine runs a step of `tokens` tokens sequence-parallel."""
        sizes = self.batch_sizes if decode_only else self.token_sizes
        return takes_sequence_parallel(self.link.size, self.min_rows, tokens, sizes)

    def rows(self, tokens: int) -> int:
        """The step's rows, padded to a multiple of the GPUs."""
        return padded_rows(tokens, self.link.size)

    def elementwise_s(self, rows: int) -> float:
        """The step's elementwise traffic: the norms on this GPU's rows, the rest on all of them."""
        return rows * (self.norm_s_per_row / self.link.size + self.other_elementwise_s_per_row)

    def boundaries_s(self, rows: int, samples: int) -> float:
        """The step's collectives: its 4 L + 2 row collectives (each fused one's beyond its GEMM's
        time) and the sampled rows' exchange."""
        c = self.link.all_gather_s(rows * self.row_bytes)  # a reduce-scatter moves as much
        if self.fused:
            per_layer = max(self.linear_weights_s, rows * self.linear_s_per_row) / self.layers
            exposed = sum(max(0.0, c - per_layer * share) for share in self.boundary_shares)
        else:
            exposed = len(self.boundary_shares) * c
        gather = self.link.all_gather_s(SAMPLED_PAIR_BYTES * self.link.size * samples)
        return self.layers * exposed + 2 * c + gather
