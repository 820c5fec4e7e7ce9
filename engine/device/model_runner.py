"""`ModelRunner`: executes one `SchedulerOutput` on the device and returns the sampled tokens.

Construction: build the model and load its weights; on a GPU, profile a forward pass at
`max_num_batched_tokens` to size the KV cache from `gpu_memory_utilization` (unless
`CacheConfig.num_gpu_blocks` is given; on CPU without it, at most CPU_KV_CACHE_GIB = 4 GiB, logged);
allocate the KV cache and the swap pool; capture CUDA graphs of whole steps unless `enforce_eager`
(always eager on CPU; buckets in `engine.device.cuda_graph`). The elementwise ops are torch.compile'd on CUDA unless `enforce_eager`
(`compile_model` overrides).

`execute(out)`: cache ops (swap out, swap in, copy), then the step's inputs go to the device in one
copy from pinned memory (`engine.device.input_batch`), then one forward over the flattened batch and the
logits of the sampled rows (a graph replay when a bucket fits the step), then sampling: one
vectorised draw when every row only needs its temperature, the full `Sampler` otherwise. The only
device sync of a step is the read of the sampled tokens.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

import kernels
from engine.config import DTYPES, CacheConfig, ModelConfig, RunnerConfig
from engine.device.attention import DEFAULT_DECODE_KERNEL, attention_ops, resolve_decode_kernel
from engine.device.batch_layout import BatchShape
from engine.device.cuda_graph import StepGraphs
from engine.device.input_batch import BatchBuilder, ModelInput, StepPlan
from engine.device.kv_cache import KVCache, block_bytes, num_cpu_blocks
from engine.device.sampler import Sampler, SampleResult, sample_with_temperatures
from engine.device.token_feedback import Feedback, Launched, TokenFeedback
from engine.device.weights import build_model
from engine.distributed.parallel_state import TPGroup
from engine.distributed.sharding import TPShard
from engine.distributed.vocab_parallel_sampling import sample_vocab_parallel
from engine.models.parallel_layers import TPContext
from kernels.prefill import max_tiles, tokens_per_tile
from policies.block_table_width import table_width
from policies.kv_pool_size import check_holds_one_sequence, check_num_gpu_blocks
from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.request import Request, SamplingParams
from policies.sequence import Sequence

logger = logging.getLogger("servelab.engine")
# KV cache on a CPU when num_gpu_blocks is not given (no device memory to profile): at most this
# many GiB, and no more than max_num_seqs requests of max_model_len tokens need. vLLM's CPU
# backend likewise takes a set KV space (VLLM_CPU_KVCACHE_SPACE) instead of profiling.
CPU_KV_CACHE_GIB = 4.0
# While a step runs, host work given as `while_waiting` gets the host in slices this long at most,
# the step's end being checked between them (each check is one event query, a few microseconds).
WAIT_SLICE_S = 1e-4


class ModelRunner:
    """`tp`: this process is one rank of a tensor-parallel group; it builds that rank's shard and a
    KV cache of its heads, with the block count every rank can hold (engine/distributed/)."""

    @classmethod
    def from_config(cls, config: RunnerConfig, device: str | torch.device = "cpu",
                    tp: TPGroup | None = None) -> ModelRunner:
        return cls(config.model_config, config.cache_config, **config.runner_kwargs(), device=device, tp=tp)

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, *,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                 enforce_eager: bool = False, seed: int = 0, attention_backend: str = "auto",
                 compile_model: bool | None = None, decode_kernel: str = DEFAULT_DECODE_KERNEL,
                 tp: TPGroup | None = None) -> None:
        self.model_config = model_config
        self.tp = tp
        shard = None if tp is None else TPShard.of(model_config, tp.rank, tp.size)
        # The model as this process holds it: its heads (the KV cache, its blocks, the kernels' tiles).
        self.local_config = model_config if shard is None else shard.local_config(model_config)
        self.cache_config = cache_config
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = _resolve_dtype(dtype, model_config, self.device)
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} is invalid: the model supports at most "
                             f"max_position_embeddings={model_config.max_position_embeddings}")
        self.block_size = cache_config.block_size
        # "auto" resolved on this device and dtype; runs and profiles record the name (their metadata).
        self.decode_kernel = resolve_decode_kernel(
            decode_kernel, self.device, self.dtype, model_config.head_dim,
            model_config.num_attention_heads // model_config.num_key_value_heads, self.block_size)
        self.ops = attention_ops(attention_backend, self.device, self.decode_kernel)
        if compile_model is None:  # vLLM's convention: enforce_eager turns off compilation too
            compile_model = self.device.type == "cuda" and not enforce_eager
        self.model = build_model(model_config, self.ops, self.device, self.dtype,
                                 max_positions=max_model_len, seed=seed, compile=compile_model,
                                 tp=None if tp is None else TPContext(shard, tp))
        self.sampler = Sampler(self.device)
        width = table_width(cache_config.blocks_per_seq(max_model_len))
        tokens = tokens_per_tile(self.local_config.num_attention_heads, self.local_config.num_key_value_heads)
        capacity = BatchShape(max_num_batched_tokens, max_num_seqs, max_num_seqs, max_num_seqs, width,
                              max_tiles(max_num_batched_tokens, max_num_seqs, tokens))
        self.batch = BatchBuilder(self.block_size, capacity, self.device, tokens, max_model_len)
        self.feedback = TokenFeedback(max_num_seqs, self.device)
        self.graphs: StepGraphs | None = None
        # Host work for the time a step's tokens are awaited (`await_event`): called with a slice in
        # seconds, it waits up to that long for work and does it; it returns False when it expects
        # none (then the wait blocks). A disaggregated front posts KV sends there, mid-step.
        self.while_waiting: Callable[[float], bool] | None = None
        self.num_gpu_blocks = cache_config.num_gpu_blocks or self._profile_num_gpu_blocks()
        self.num_cpu_blocks = num_cpu_blocks(cache_config.swap_space, self.local_config, self.block_size,
                                             self.dtype)
        if tp is not None:  # one block table serves every rank
            self.num_gpu_blocks = tp.min_int(self.num_gpu_blocks)
            self.num_cpu_blocks = tp.min_int(self.num_cpu_blocks)
        if cache_config.num_gpu_blocks is not None or self.device.type != "cuda":  # a count given, or the CPU's
            check_num_gpu_blocks(self.num_gpu_blocks, self.block_size, max_model_len)
        else:  # sized from the memory a profiling pass left
            check_holds_one_sequence(self.num_gpu_blocks, self.block_size, max_model_len, "gpu_memory_utilization",
                                     cache_config.gpu_memory_utilization)
        self.kv_cache = KVCache(self.local_config, self.block_size, self.num_gpu_blocks, self.num_cpu_blocks,
                                self.device, self.dtype, self.ops)
        self.model.bind_kv_cache(self.kv_cache.k_caches, self.kv_cache.v_caches)
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = StepGraphs(self.model, self.batch, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens, width=width,
                                     eager_from=0 if tp is None else tp.sequence_parallel_from)
        if self.device.type == "cuda":
            self._warm_sampler()

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> dict[int, SampleResult]:
        """Run one step; returns {seq_id: SampleResult} for every scheduled seq with num_samples > 0."""
        return self.collect(self.launch(out))

    @torch.no_grad()
    def launch(self, out: SchedulerOutput, after: Launched | None = None) -> Launched:
        """Start one step on the device and return without waiting for it (`collect` waits), except
        for steps that need the full `Sampler`, which finish here. `after`: the step launched before
        this one, not yet collected, whose sampled tokens are the inputs of this step's rows holding
        a PENDING token (scheduled ahead, policies/lookahead.py); they go device to device."""
        self.kv_cache.apply(out.swap_out, out.swap_in, out.copy)
        if not out.scheduled:
            return Launched(StepPlan(), {})
        plan = self.batch.plan(out.scheduled)
        temperatures = self.sampler.fast_temperatures(plan.sampled)
        feedback = self.feedback.sources(plan, after) if after is not None else None
        logits, inputs = self._forward(plan, temperatures, feedback)
        if not plan.sampled:
            return Launched(plan, {})
        rows = len(plan.sampled)
        if temperatures is None:
            full = self.model.gather_logits(logits[:rows])
            self.await_forward()  # the sampler reads its results on the host
            results = self.sampler(full, plan.sampled)
            return Launched(plan, {s.seq.seq_id: r for s, r in zip(plan.sampled, results)})
        tokens = self.sample_fast(logits[:rows], inputs.temperatures[:rows], temperatures)
        return Launched(plan, None, tokens, self.feedback.download(tokens))

    def sample_fast(self, logits: torch.Tensor, temperatures: torch.Tensor, temperature_list: list[float]) -> torch.Tensor:
        """The sampler's fast path (every row needs only its temperature) on the model's logit
        columns -> tokens [R] on the device (a tensor-parallel rank 0 draws from its columns and
        exchanges the best with the other ranks: engine/distributed/driver.py)."""
        return sample_with_temperatures(logits, temperatures, temperature_list)

    def sample_shard(self, logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
        """A tensor-parallel rank's part of the fast path, the same call on every rank: its logit
        columns -> the tokens drawn over all of them with `seed` (engine/distributed/vocab_parallel_sampling.py)."""
        start, _ = self.model.vocab_columns
        return sample_vocab_parallel(logits, temperatures, seed, self.tp, start, self.model_config.vocab_size)

    def collect(self, launched: Launched) -> dict[int, SampleResult]:
        """Wait for a launched step's tokens: {seq_id: SampleResult} per sampling sequence."""
        if launched.results is None:
            tokens = self.feedback.wait(launched.host_tokens, self.await_event)
            launched.results = {s.seq.seq_id: SampleResult([t]) for s, t in zip(launched.plan.sampled, tokens)}
        return launched.results

    def await_event(self, event: torch.cuda.Event) -> None:
        """Wait until the work recorded before `event` is done (a tensor-parallel rank 0 bounds it),
        giving the time to `while_waiting` while it has work."""
        work = self.while_waiting
        while work is not None and not event.query() and work(WAIT_SLICE_S):
            pass
        event.synchronize()

    def await_forward(self) -> None:
        """Before host reads of the step just launched: here they wait by themselves (a
        tensor-parallel rank 0 waits for the step first, bounded)."""

    def close(self) -> None:
        """Free the graphs, drop the model and KV cache (their device memory is freed once unreferenced)."""
        if self.graphs is not None:
            self.graphs.release()
        self.model = self.kv_cache = self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self, seq_ids) -> None:
        """Forget per-sequence state (seeded generators) of finished sequences."""
        self.sampler.release(seq_ids)

    def _forward(self, plan: StepPlan, temperatures: list[float] | None, feedback: Feedback | None = None):
        """-> (logits of the sampled rows, padded or not; the step's ModelInput)."""
        shape = self.graphs.shape_for(plan) if self.graphs is not None else None
        inputs = self._write_inputs(plan, shape, temperatures)
        if feedback is not None:
            self.feedback.apply(feedback, inputs.input_ids)
        return self.forward_inputs(shape, inputs, bool(plan.sampled)), inputs

    def _write_inputs(self, plan: StepPlan, shape: BatchShape | None,
                      temperatures: list[float] | None) -> ModelInput:
        """Write the step's inputs, padded to the graph's `shape` (None: eager, exact shape)."""
        if shape is not None:
            self.batch.write(plan, shape, temperatures)
            return self.graphs.inputs[shape]
        return self.batch.prepare(plan, plan.shape(), temperatures)

    def forward_inputs(self, shape: BatchShape | None, inputs: ModelInput, sampled: bool) -> torch.Tensor | None:
        """The forward and the model's logit columns of the sampled rows (if `sampled`; a
        tensor-parallel rank's share of the vocabulary): a replay of `shape`'s graph, or eager."""
        if shape is not None:
            return self.graphs.run(shape)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not sampled:
            return None
        return self.model.compute_local_logits(hidden[inputs.sample_rows])

    def _warm_sampler(self) -> None:
        """One tempered draw now, so the fast sampling path's Triton kernels are compiled (or loaded
        from Triton's cache) at start-up, as vLLM's dummy sampler run does, not in the first step
        that samples with a temperature (~1 s on a machine with an empty cache)."""
        logits = torch.zeros(1, self.model_config.vocab_size, dtype=self.dtype, device=self.device)
        temperatures = torch.ones(1, dtype=torch.float32, device=self.device)
        sample_with_temperatures(logits, temperatures, [1.0])
        if self.tp is not None:  # a rank's part of the draw (no exchange: nothing else runs it now)
            start, width = self.model.vocab_columns
            kernels.sample_gumbel_shard(logits[:, :width], temperatures, 0, start, self.model_config.vocab_size)
        torch.cuda.synchronize(self.device)

    def _default_cpu_blocks(self) -> int:
        per_block = block_bytes(self.local_config, self.block_size, self.dtype)
        needed = self.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
        blocks = max(1, min(needed, int(CPU_KV_CACHE_GIB * 2**30) // per_block))
        logger.warning("KV cache on CPU: num_gpu_blocks not set, so %d blocks of %d tokens (%.2f GiB; "
                       "the default is at most %.0f GiB); set num_gpu_blocks to choose", blocks,
                       self.block_size, blocks * per_block / 2**30, CPU_KV_CACHE_GIB)
        return blocks

    @torch.no_grad()
    def _profile_num_gpu_blocks(self) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the GPU after the peak of a forward pass at
        max_num_batched_tokens (plus logits and sampling of max_num_seqs rows)."""
        if self.device.type != "cuda":
            return self._default_cpu_blocks()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.max_num_batched_tokens, self.max_num_seqs * self.max_model_len)
        num_seqs = max(1, min(self.max_num_seqs, num_tokens))
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        temp_blocks = sum(math.ceil(n / self.block_size) for n in lens)
        temp = KVCache(self.local_config, self.block_size, temp_blocks, 0, self.device, self.dtype, self.ops)
        temp_bytes = temp_blocks * block_bytes(self.local_config, self.block_size, self.dtype)
        self.model.bind_kv_cache(temp.k_caches, temp.v_caches)
        # The full sampler's worst case: every filter, logprobs and penalties (token count tables).
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=5,
                                presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
        scheduled, next_block = [], 0
        for i, n in enumerate(lens):
            seq = Sequence.from_request(i, Request(f"profile-{i}", [0] * n, params))
            blocks = math.ceil(n / self.block_size)
            seq.block_table = list(range(next_block, next_block + blocks))
            next_block += blocks
            scheduled.append(ScheduledSeq(seq, n, 1))
        plan = self.batch.plan(scheduled)
        logits, _ = self._forward(plan, None)
        self.sampler(self.model.gather_logits(logits), plan.sampled)
        torch.cuda.synchronize(self.device)
        del logits, temp
        self.model.bind_kv_cache([None] * len(self.model.layers), [None] * len(self.model.layers))
        peak = torch.cuda.max_memory_allocated(self.device) - temp_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = total * self.cache_config.gpu_memory_utilization - non_torch - peak
        torch.cuda.empty_cache()
        return max(0, int(budget // block_bytes(self.local_config, self.block_size, self.dtype)))


def _resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype is None:
        return cfg.torch_dtype if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype} is invalid: one of {tuple(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: one of {tuple(DTYPES)}")
    return DTYPES[dtype]
