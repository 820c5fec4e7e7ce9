"""`EngineArgs`: every knob of `LLMEngine` / `LLM` in one flat dataclass (vLLM's names), and
the configs built from it for the model runner and the scheduler."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine.config import (
    CacheConfig,
    ModelConfig,
    RunnerConfig,
    check_device,
    check_seed,
    reject_unknown_fields,
    resolve_device,
)
from engine.device.attention import DECODE_KERNELS, DEFAULT_DECODE_KERNEL
from engine.model_loader import load_model_config
from engine.models import MODELS
from engine.parallel_config import CUSTOM_ALL_REDUCE_MAX_BYTES, DISABLE_CUSTOM_ALL_REDUCE, ParallelConfig
from policies.blocks import BLOCK_MANAGERS, BlockManagerConfig
from policies.build import SchedulingConfig, block_manager_config, policy_config
from policies.kv_pool_size import DEFAULT as DEFAULT_MEMORY_UTILIZATION
from policies.kv_pool_size import check_num_gpu_blocks
from policies.model_shape import resolve_max_model_len
from policies.policy.base import POLICIES, PREEMPTION_MODES, PolicyConfig
from policies.scheduler_config import SchedulerConfig
from policies.tensor_parallel import check_tensor_parallel_size


@dataclass(slots=True)
class EngineArgs:
    model: str | ModelConfig = "tiny-llama"  # conf/model name, local HF dir, .gguf path, or a ModelConfig
    dtype: str | None = None  # None: the model's (conf/model yaml or config.json)
    device: str | None = None  # "cpu", "cuda" or "cuda:<index>"; None: "cuda" when available, else "cpu"
    tokenizer: str | None = None  # None: from the model's weights (none for dummy weights)
    detokenize: bool = True  # False: outputs carry token ids only (text "") unless stop strings are set
    # Scheduling (policies/): which block manager and policy, and the step budget.
    block_manager: str = "paged"  # paged | prefix | contiguous
    # The block manager's own knobs (its config beyond block_size and watermark, policies/blocks/).
    block_manager_config: dict[str, Any] = field(default_factory=dict)
    policy: str = "fcfs"
    # The policy's own knobs (its config dataclass: `LLM(policy="srpt", policy_config={"aging": 1.0})`).
    policy_config: dict[str, Any] = field(default_factory=dict)
    preemption_mode: str = "recompute"  # recompute | swap
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    # Schedule and launch each step while the one before it runs (vLLM v1's async scheduling;
    # SchedulerConfig.async_scheduling, policies/lookahead.py).
    async_scheduling: bool = True
    # With async scheduling, a request a disaggregated pair's decode engine receives joins the step
    # after the one in flight instead of making that step synchronous (SchedulerConfig.join_ahead).
    join_ahead: bool = True
    watermark: float = 0.01
    # KV cache.
    block_size: int = 16
    gpu_memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    swap_space: float = 4.0  # GiB of pinned CPU memory
    num_gpu_blocks: int | None = None  # override the profiled count (CPU: default at most 4 GiB)
    enforce_eager: bool = False  # True: no CUDA graphs
    # Triton decode attention: "auto" (Gluon "tma" on Hopper with fp16/bf16, else "packed"), "packed",
    # "per-head" or "tma" (engine/device/attention.py).
    decode_kernel: str = DEFAULT_DECODE_KERNEL
    # Seeds the dummy weights (every rank builds the same ones): an integer in [-2**63, 2**63 - 1];
    # None is the default 0, so dummy-weight runs stay reproducible (requests' own seeds: SamplingParams).
    seed: int | None = 0
    # The most top logprobs a request may ask for (vLLM's max_logprobs; -1: up to the vocabulary).
    max_logprobs: int = 20
    # Tensor parallelism (docs/parallelism.md): shard the model over this many GPUs (processes on
    # CPU), rank 0 in this process and workers spawned by the engine; 1 is the single-process path.
    tensor_parallel_size: int = 1
    # A step rank 0 waits on this long (a worker silent in it) is reported hung: NCCL's collectives'
    # timeout, and rank 0's bound on its wait for a step's tokens (engine/distributed/step_wait.py).
    distributed_timeout_s: float = 300.0
    # All-reduces on GPUs (vLLM's name; engine/distributed/all_reduce_path.py): one-shot over
    # symmetric memory up to the first size (None: by world size), two-shot up to the second, NCCL
    # above (the default); True sends every all-reduce through NCCL.
    disable_custom_all_reduce: bool = DISABLE_CUSTOM_ALL_REDUCE
    custom_all_reduce_one_shot_max_bytes: int | None = None
    custom_all_reduce_max_bytes: int = CUSTOM_ALL_REDUCE_MAX_BYTES
    # The symmetric paths' kernels: "auto" ("triton_lamport" at two ranks, "torch" at others), "torch",
    # "triton", "triton_fused" (the layer boundary's all-reduce, residual add and RMSNorm in one
    # kernel) or "triton_lamport" (the same without barriers); engine/parallel_config.py's ParallelConfig.
    all_reduce_kernel: str = "auto"
    # Steps of at least this many tokens run their layers sequence-parallel, eagerly (reduce-scatter
    # and all-gather fused with the GEMMs instead of all-reduces); 0: off (ParallelConfig).
    sequence_parallel_min_rows: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig) and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model={self.model!r} is invalid: a conf/model name, an HF dir or a .gguf file")
        if self.block_manager not in BLOCK_MANAGERS:
            raise ValueError(f"block_manager={self.block_manager!r} is invalid: "
                             f"choose one of {tuple(BLOCK_MANAGERS)}")
        for name in ("policy_config", "block_manager_config"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: a dict of knobs")  # noqa: TRY004
        if isinstance(self.model, ModelConfig):
            MODELS.get(self.model.architecture)  # ValueError naming the registered ones
        POLICIES.get(self.policy)  # ValueError naming the registered policies
        self._policy_config(), self._block_manager_config()  # an unknown knob, refused here
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r} is invalid: "
                             f"choose one of {PREEMPTION_MODES}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel={self.decode_kernel!r} is invalid: choose one of {DECODE_KERNELS}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} is invalid: an integer >= 0, or -1 (no cap "
                             "below the vocabulary size)")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 2):
            raise ValueError(f"max_model_len={self.max_model_len!r} is invalid: None or an integer >= 2")
        check_tensor_parallel_size(self.tensor_parallel_size)
        if isinstance(self.distributed_timeout_s, bool) or not (isinstance(self.distributed_timeout_s, (int, float))
                                                                and self.distributed_timeout_s > 0):
            raise ValueError(f"distributed_timeout_s={self.distributed_timeout_s!r} is invalid: must be a number > 0")
        self.parallel_config()  # the all-reduce settings: a ValueError naming the field
        if self.seed is None:
            self.seed = 0
        check_seed(self.seed)
        if type(self.join_ahead) is not bool:  # a run config's string would otherwise read as true
            raise ValueError(f"join_ahead={self.join_ahead!r} is invalid: must be True or False")
        check_device(self.device)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineArgs:
        reject_unknown_fields(cls, d, "engine arguments")
        return cls(**d)

    def check(self) -> None:
        """Build the configs that need no weights (model shapes, KV cache sizing, max_model_len), so a
        bad value is a ValueError naming it before anything loads."""
        self.cache_config()
        self.check_kv_pool(self.resolve_max_model_len(self.model_config()))

    def check_kv_pool(self, max_model_len: int) -> None:
        """A `num_gpu_blocks` given must hold one max_model_len sequence, refused before anything
        loads (the model runner checks a profiled count alike)."""
        if self.num_gpu_blocks is not None:
            check_num_gpu_blocks(self.num_gpu_blocks, self.block_size, max_model_len)

    def resolve_device(self) -> str:
        """The device to run on (None picked); a CUDA device this machine lacks is a ValueError."""
        return resolve_device(self.device)

    def model_config(self) -> ModelConfig:
        """The model's config; its architecture must be a registered model class's."""
        if isinstance(self.model, ModelConfig):
            cfg = self.model if self.dtype is None else dataclasses.replace(self.model, dtype=self.dtype)
        else:
            cfg = load_model_config(self.model, dtype=self.dtype)
        MODELS.get(cfg.architecture)  # ValueError naming the registered ones
        return cfg

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                           swap_space=self.swap_space, num_gpu_blocks=self.num_gpu_blocks)

    def runner_config(self, model: ModelConfig, max_model_len: int) -> RunnerConfig:
        return RunnerConfig(model, self.cache_config(), max_num_batched_tokens=self.max_num_batched_tokens,
                            max_num_seqs=self.max_num_seqs, max_model_len=max_model_len, dtype=self.dtype,
                            enforce_eager=self.enforce_eager, seed=self.seed, decode_kernel=self.decode_kernel)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.distributed_timeout_s, self.disable_custom_all_reduce,
                              self.custom_all_reduce_one_shot_max_bytes, self.custom_all_reduce_max_bytes,
                              self.all_reduce_kernel, self.sequence_parallel_min_rows)

    def scheduling_config(self, max_model_len: int) -> SchedulingConfig:
        """The scheduler these arguments describe, typed (policies/build.py builds it)."""
        budgets = SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                  max_num_seqs=self.max_num_seqs, max_model_len=max_model_len,
                                  enable_chunked_prefill=self.enable_chunked_prefill,
                                  async_scheduling=self.async_scheduling, join_ahead=self.join_ahead)
        return SchedulingConfig(budgets, self._policy_config(), self._block_manager_config())

    def _policy_config(self) -> PolicyConfig:
        return policy_config(self.policy, {"preemption_mode": self.preemption_mode, **self.policy_config},
                             where="policy_config")

    def _block_manager_config(self) -> BlockManagerConfig:
        return block_manager_config(self.block_manager, {"block_size": self.block_size, "watermark": self.watermark,
                                                         **self.block_manager_config}, where="block_manager_config")

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        return resolve_max_model_len(self.max_model_len, model.max_position_embeddings)
