"""`ModelRunner`: executes one `SchedulerOutput` on the device and returns the sampled tokens.

Construction: build the model and load its weights; on a GPU, profile a forward pass at
`max_num_batched_tokens` to size the KV cache from `gpu_memory_utilization` (unless
`CacheConfig.num_gpu_blocks` is given; on CPU it must be); allocate the KV cache and the swap
pool; capture decode CUDA graphs unless `enforce_eager` (always eager on CPU). The elementwise
ops are torch.compile'd on CUDA unless `enforce_eager` (`compile_model` overrides).

`execute(out)`: cache ops (swap out, swap in, copy) then one forward over the flattened batch
(a captured graph when every scheduled sequence decodes one token), logits of the sampled rows
only, then the sampler.
"""
from __future__ import annotations

import math

import torch

from engine.attention import attention_ops
from engine.config import DTYPES, CacheConfig, ModelConfig
from engine.cuda_graph import DecodeGraphs
from engine.input_batch import build_host_batch, to_device
from engine.kv_cache import KVCache, block_bytes, num_cpu_blocks
from engine.sampler import Sampler, SampleResult
from engine.weights import build_model
from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.request import Request, SamplingParams
from policies.sequence import Sequence


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, *,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                 enforce_eager: bool = False, seed: int = 0, attention_backend: str = "auto",
                 compile_model: bool | None = None) -> None:
        self.model_config = model_config
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
        self.ops = attention_ops(attention_backend, self.device)
        if compile_model is None:  # vLLM's convention: enforce_eager turns off compilation too
            compile_model = self.device.type == "cuda" and not enforce_eager
        self.model = build_model(model_config, self.ops, self.device, self.dtype,
                                 max_positions=max_model_len, seed=seed, compile=compile_model)
        self.sampler = Sampler(self.device)
        self.num_gpu_blocks = cache_config.num_gpu_blocks or self._profile_num_gpu_blocks()
        self.num_cpu_blocks = num_cpu_blocks(cache_config.swap_space, model_config, self.block_size,
                                             self.dtype)
        needed = cache_config.blocks_per_seq(max_model_len)
        if self.num_gpu_blocks < needed:
            raise ValueError(
                f"KV cache too small: one max_model_len={max_model_len} request needs {needed} blocks "
                f"of {self.block_size} tokens, but only {self.num_gpu_blocks} fit (gpu_memory_utilization="
                f"{cache_config.gpu_memory_utilization}, num_gpu_blocks={cache_config.num_gpu_blocks}); "
                "lower max_model_len or give the cache more memory")
        self.kv_cache = KVCache(model_config, self.block_size, self.num_gpu_blocks, self.num_cpu_blocks,
                                self.device, self.dtype, self.ops)
        self.model.bind_kv_cache(self.kv_cache.k_caches, self.kv_cache.v_caches)
        self.graphs = None
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = DecodeGraphs(self.model, max_num_seqs, needed, self.device)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> dict[int, SampleResult]:
        """Run one step; returns {seq_id: SampleResult} for every scheduled seq with num_samples > 0."""
        self.kv_cache.apply(out.swap_out, out.swap_in, out.copy)
        if not out.scheduled:
            return {}
        hidden, host = self._forward(out.scheduled)
        if not host.sampled:
            return {}
        rows = torch.from_numpy(host.sample_rows).to(self.device)
        logits = self.model.compute_logits(hidden[rows])
        results = self.sampler(logits, host.sampled)
        return {s.seq.seq_id: r for s, r in zip(host.sampled, results)}

    def release(self, seq_ids) -> None:
        """Forget per-sequence state (seeded generators) of finished sequences."""
        self.sampler.release(seq_ids)

    def _forward(self, scheduled: list[ScheduledSeq]):
        bucket = None
        if self.graphs is not None and all(s.num_new_tokens == 1 for s in scheduled):
            bucket = self.graphs.bucket(len(scheduled))
        host = build_host_batch(scheduled, self.block_size, pad_decode_to=bucket)
        if bucket is not None and host.decode_block_tables.shape[1] <= self.graphs.block_tables.shape[1]:
            return self.graphs.run(host), host
        batch = to_device(host, self.device)
        return self.model(batch.input_ids, batch.positions, batch.meta), host

    @torch.no_grad()
    def _profile_num_gpu_blocks(self) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the GPU after the peak of a forward pass at
        max_num_batched_tokens (plus logits and sampling of max_num_seqs rows)."""
        if self.device.type != "cuda":
            raise ValueError("num_gpu_blocks=None is invalid on CPU: set CacheConfig.num_gpu_blocks "
                             "(there is no GPU memory to profile)")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.max_num_batched_tokens, self.max_num_seqs * self.max_model_len)
        num_seqs = max(1, min(self.max_num_seqs, num_tokens))
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        temp_blocks = sum(math.ceil(n / self.block_size) for n in lens)
        temp = KVCache(self.model_config, self.block_size, temp_blocks, 0, self.device, self.dtype, self.ops)
        temp_bytes = temp_blocks * block_bytes(self.model_config, self.block_size, self.dtype)
        self.model.bind_kv_cache(temp.k_caches, temp.v_caches)
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=5)
        scheduled, next_block = [], 0
        for i, n in enumerate(lens):
            seq = Sequence.from_request(i, Request(f"profile-{i}", [0] * n, params))
            blocks = math.ceil(n / self.block_size)
            seq.block_table = list(range(next_block, next_block + blocks))
            next_block += blocks
            scheduled.append(ScheduledSeq(seq, n, 1))
        host = build_host_batch(scheduled, self.block_size)
        batch = to_device(host, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        self.sampler(self.model.compute_logits(hidden[batch.sample_rows]), host.sampled)
        torch.cuda.synchronize(self.device)
        del hidden, batch, temp
        self.model.bind_kv_cache([None] * len(self.model.layers), [None] * len(self.model.layers))
        peak = torch.cuda.max_memory_allocated(self.device) - temp_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = total * self.cache_config.gpu_memory_utilization - non_torch - peak
        torch.cuda.empty_cache()
        return max(0, int(budget // block_bytes(self.model_config, self.block_size, self.dtype)))


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
