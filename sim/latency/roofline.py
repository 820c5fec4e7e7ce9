"""Analytic roofline latency model.

A step runs four phases one after the other; each costs max(bytes / (bw * eb), flops / (rate * e))
with bw = `hbm_bandwidth`, rate = peak FLOP/s for the model dtype, eb = `bandwidth_efficiency`:

1. GEMMs: bytes = every layer's weights + the LM head (`ModelShape.step_weight_bytes`);
   flops = 2 * tokens * linear_params + 2 * samples * vocab * hidden; efficiency `gemm_efficiency`.
2. Elementwise kernels (norms, RoPE, activation, residuals): bytes = tokens * activation bytes/token.
3. Decode attention (q == 1): bytes = (sum of c + 1) KV entries read, an entry of a block another
   decode of the batch reads too at `Hardware.kv_reread_cost` of a fresh one (L2, not HBM);
   flops = 4 L H D per (query, key) pair; efficiency `attention_efficiency`.
4. Prefill attention (q > 1): bytes = (sum of c + q) KV entries (the prefix read plus the new
   tokens written and read); flops = 4 L H D * sum(q c + q (q + 1) / 2) (causal).
Plus copy-on-write copies (read + write a block each) and a fixed `step_overhead_s`.
With `tensor_parallel_size` N > 1 every byte and FLOP above is one GPU's share (its heads, MLP
columns and vocabulary: sim/latency/tensor_parallel.py), and the step adds its all-reduces and
the sampled rows' exchange over `interconnect_bandwidth` / `interconnect_latency_s`; a step the
engine runs sequence-parallel (`parallel.sequence_parallel_min_rows`) has its layer boundaries'
collectives in their place (sim/latency/sequence_parallel_roofline.py).
Swap: `swap_latency_s + n * (block_bytes / host_link_bandwidth + swap_block_overhead_s)`.
"""
from __future__ import annotations

from policies.outputs import SchedulerOutput
from policies.tensor_parallel import check_tensor_parallel_size
from sim.latency.base import BatchShape, LatencyModel, shape_decode_times
from sim.latency.build import LATENCY_MODELS, LatencyConfig, LatencySetup
from sim.latency.sequence_parallel_roofline import SequenceParallelRoofline
from sim.latency.shapes import Hardware, ModelShape
from sim.latency.tensor_parallel import TPCommCost, shard_shape


@LATENCY_MODELS.register("roofline", config=LatencyConfig)
class RooflineModel(LatencyModel):
    name = "roofline"
    prices_sequence_parallel = True

    @classmethod
    def from_config(cls, config: LatencyConfig, setup: LatencySetup) -> RooflineModel:
        model = cls(setup.model, setup.hardware, setup.block_size, setup.tensor_parallel_size)
        model.sequence_parallel = SequenceParallelRoofline.for_run(
            setup, model.model, bandwidth=setup.hardware.hbm_bandwidth * setup.hardware.bandwidth_efficiency,
            gemm_s_per_token=model._gemm_s_per_token)
        return model

    def __init__(self, model: ModelShape, hardware: Hardware, block_size: int,
                 tensor_parallel_size: int = 1) -> None:
        if not isinstance(model, ModelShape):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                f"model={type(model).__name__} is invalid: a ModelShape (ModelShape.from_dict of a conf/model mapping)")
        if not isinstance(hardware, Hardware):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                f"hardware={type(hardware).__name__} is invalid: a Hardware (Hardware.from_dict of a conf/hardware "
                "mapping)")
        self.set_reread_cost(hardware.kv_reread_cost, block_size)  # checks block_size
        check_tensor_parallel_size(tensor_parallel_size)
        self.tensor_parallel_size = tensor_parallel_size
        self.comm = TPCommCost.of(model, hardware, tensor_parallel_size)
        model = shard_shape(model, tensor_parallel_size)  # one GPU's share
        self.model, self.hardware, self.block_size = model, hardware, block_size
        bw = hardware.hbm_bandwidth * hardware.bandwidth_efficiency
        rate = hardware.flops_for(model.dtype_bytes)
        # Everything below is per-step constants turned into seconds-per-unit, so step_time is a
        # handful of multiplications after one pass over the batch.
        self._weights_s = model.step_weight_bytes / bw
        self._gemm_s_per_token = 2 * model.linear_params / (rate * hardware.gemm_efficiency)
        self._gemm_s_per_sample = 2 * model.lm_head_params / (rate * hardware.gemm_efficiency)
        self._act_s_per_token = model.activation_bytes_per_token / bw
        self._kv_s_per_token = model.kv_bytes_per_token / bw
        self._attn_s_per_pair = model.attention_flops_per_pair / (rate * hardware.attention_efficiency)
        self.block_bytes = model.kv_bytes_per_token * block_size
        self._copy_s_per_block = 2 * self.block_bytes / bw
        self._overhead_s = hardware.step_overhead_s
        self._swap_s_per_block = (self.block_bytes / hardware.host_link_bandwidth
                                  + hardware.swap_block_overhead_s)
        self._swap_latency_s = hardware.swap_latency_s
        # The engine's sequence-parallel steps (`parallel.sequence_parallel_min_rows`), set by
        # `from_config`; None: every step runs the all-reduce path.
        self.sequence_parallel: SequenceParallelRoofline | None = None
        self._decode_fixed_s: dict[tuple[int, int], float] = {}  # decode_times' part per (seqs, samples)

    def step_time(self, out: SchedulerOutput) -> float:
        return self.shape_time(BatchShape.of(out, block_size=self._shared_block_size))

    def shape_time(self, b: BatchShape) -> float:
        tokens = b.num_prefill_tokens + b.num_decode_seqs
        if tokens == 0 and b.num_copies == 0:
            return 0.0
        t = self._overhead_s + b.num_copies * self._copy_s_per_block
        sp = self.sequence_parallel
        if sp is not None and tokens and sp.takes(tokens, decode_only=not b.num_prefill_tokens):
            rows = sp.rows(tokens)
            gemm_compute = rows * self._gemm_s_per_token + b.num_samples * self._gemm_s_per_sample
            t += max(self._weights_s, gemm_compute) + sp.elementwise_s(rows) + sp.boundaries_s(rows, b.num_samples)
        elif tokens:
            gemm_compute = tokens * self._gemm_s_per_token + b.num_samples * self._gemm_s_per_sample
            t += max(self._weights_s, gemm_compute) + tokens * self._act_s_per_token
            if self.tensor_parallel_size > 1:
                t += self.comm.step_s(tokens, b.num_samples)
        if b.num_decode_seqs:
            t += max(b.kv_read_tokens(self.kv_reread_cost) * self._kv_s_per_token,
                     b.num_context_tokens * self._attn_s_per_pair)
        if b.num_prefill_tokens:
            kv = b.prefill_context_tokens + b.num_prefill_tokens
            t += max(kv * self._kv_s_per_token, b.prefill_attention_pairs * self._attn_s_per_pair)
        return t

    def decode_times(self, num_seqs: int, num_context_tokens: int, num_samples: int,
                     num_steps: int, max_context_tokens: int = 0,
                     num_shared_context_tokens: int = 0) -> list[float]:
        if num_shared_context_tokens and self.prices_shared_reads:
            return shape_decode_times(self.shape_time, num_seqs, num_context_tokens, num_samples, num_steps,
                                      max_context_tokens, num_shared_context_tokens)
        # shape_time of a decode-only batch with its context-independent part computed once, in the
        # same order, so that every step time is bit-identical to step_time's. For ctx >= 0,
        # max(ctx * kv, ctx * attn) == ctx * max(kv, attn) exactly: rounding is monotone.
        key = (num_seqs, num_samples)
        fixed = self._decode_fixed_s.get(key)
        if fixed is None:
            fixed = self._decode_fixed_s[key] = self.shape_time(BatchShape(0, 0, 0, 0, num_seqs, 0, num_samples, 0))
        per_token = max(self._kv_s_per_token, self._attn_s_per_pair)
        end = num_context_tokens + num_steps * num_seqs
        return [fixed + ctx * per_token for ctx in range(num_context_tokens, end, num_seqs)]

    def swap_time(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self._swap_latency_s + num_blocks * self._swap_s_per_block
