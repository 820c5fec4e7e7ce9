"""Config -> objects: model/hardware shapes (experiments/lib/config_parts.py), KV block counts
(experiments/lib/kv_pool.py), scheduler, latency model, workload.

Every check raises ValueError naming the config key (`blocks.block_size=0 is invalid: ...`), which
the entry points print as one line.
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from experiments.lib.config_parts import (
    block_size,
    gpu_model_shape,
    hardware,
    model_shape,
    section,
    tensor_parallel_size,
)
from experiments.lib.kv_pool import kv_block_counts as kv_block_counts
from experiments.lib.paths import resolve_path
from experiments.lib.workloads import Workload, build_workload
from policies.build import SchedulingConfig, block_manager_config, policy_config, scheduler_config
from policies.build import build_scheduler as build
from policies.model_shape import resolve_max_model_len
from policies.scheduler import Scheduler
from policies.sequence_parallel import sequence_parallel_from
from sim.latency import (
    LATENCY_MODELS,
    LatencyConfig,
    LatencyModel,
    LatencySetup,
    build_latency_model,
)
from sim.latency.build import EngineAllReduce

ALL_REDUCE_SETTINGS = ("disable_custom_all_reduce", "custom_all_reduce_one_shot_max_bytes",
                       "custom_all_reduce_max_bytes", "all_reduce_kernel")
# The all-reduce settings and the engine's other `parallel` settings (sequence-parallel steps:
# sim/latency/sequence_parallel_pricing.py prices them).
ENGINE_PARALLEL_SETTINGS = (*ALL_REDUCE_SETTINGS, "sequence_parallel_min_rows")


def all_reduce_settings(cfg: DictConfig, keys: tuple[str, ...] = ALL_REDUCE_SETTINGS) -> dict[str, Any]:
    """The `parallel` block's all-reduce settings (or `keys`) that are set (null: the engine's
    default), as `EngineArgs` / `ParallelConfig` keyword arguments."""
    parallel = section(cfg, "parallel") if cfg.get("parallel") is not None else {}
    return {k: parallel[k] for k in keys if parallel.get(k) is not None}


def parallel_config(cfg: DictConfig):
    """The `parallel` block as the engine's `ParallelConfig`, checked by the engine's own rules
    (its kernels, byte limits, sequence-parallel rows) on every backend: a value the engine would
    refuse is refused by the simulator too, though most of them price nothing at one GPU."""
    from engine.parallel_config import ParallelConfig
    tp = tensor_parallel_size(cfg)
    try:
        return ParallelConfig(tp, **all_reduce_settings(cfg, ENGINE_PARALLEL_SETTINGS))
    except ValueError as e:
        raise ValueError(f"parallel.{e}") from None


def engine_all_reduce(cfg: DictConfig) -> EngineAllReduce:
    """The all-reduce path the engine takes for each message at this config's tensor-parallel size,
    model dtype and `parallel` settings, and whose kernels sum it: the engine's own rules
    (`choose_path`, `settings_reason`, `ParallelConfig.kernel_for`, `fits_add_rms_norm`)."""
    from engine.config import DTYPES
    from engine.distributed.all_reduce_path import NCCL, SYMMETRIC_DTYPES, choose_path, settings_reason
    from engine.parallel_config import FUSED_ALL_REDUCE_KERNELS

    tp, dtype_name = tensor_parallel_size(cfg), str(section(cfg, "model").get("dtype"))
    parallel = parallel_config(cfg)
    dtype = DTYPES.get(dtype_name)
    one_shot, two_shot = parallel.one_shot_max_bytes(tp), parallel.custom_all_reduce_max_bytes
    reason = settings_off = settings_reason(parallel, tp)
    if reason is None and dtype not in SYMMETRIC_DTYPES:
        taken = [str(d).removeprefix("torch.") for d in SYMMETRIC_DTYPES]
        reason = f"model.dtype={dtype_name}: the kernels take {taken}"
    kernel = parallel.kernel_for(tp)
    if reason is not None:  # a dtype the kernels do not take still leaves the group its symmetric memory
        return EngineAllReduce(lambda nbytes: NCCL, one_shot, two_shot, reason, kernel,
                               symmetric_memory_on=settings_off is None)
    fuses_width = None
    if kernel in FUSED_ALL_REDUCE_KERNELS:  # the engine's rule for the rows its fused kernels take
        from kernels.all_reduce import fits_add_rms_norm as fuses_width
    return EngineAllReduce(lambda nbytes: choose_path(nbytes, dtype, True, one_shot, two_shot), one_shot, two_shot,
                           kernel=kernel, fuses_width=fuses_width, symmetric_memory_on=True)


def build_predictor(cfg: DictConfig, workload: Workload | None):
    """The policy's output-length predictor (experiments/lib/predictors.py), or None if it has none."""
    from experiments.lib.predictors import build_predictor as build
    spec = section(cfg, "policy").get("predictor")
    if spec is None:
        return None
    workload_cfg = section(cfg, "workload") if cfg.get("workload") is not None else None
    return build(spec, workload, workload_cfg, int(cfg.get("seed") or 0), model_shape(cfg).vocab_size)


def scheduling_config(cfg: DictConfig, workload: Workload | None = None) -> SchedulingConfig:
    """The typed description of this config's scheduler (policy, block manager, budgets).
    `workload`: the run's, for a policy whose predictor reads its true output lengths (the oracle)."""
    pol = section(cfg, "policy")
    policy = policy_config(pol.get("name"), pol)
    if getattr(policy, "predictor", None) is not None:
        policy.predictor = build_predictor(cfg, workload)
    blocks = section(cfg, "blocks")
    scheduler = scheduler_config(section(cfg, "scheduler"))
    shape = model_shape(cfg)
    resolve_max_model_len(scheduler.max_model_len, shape.max_position_embeddings, "scheduler.max_model_len",
                          shape.name)
    return SchedulingConfig(scheduler, policy, block_manager_config(blocks.get("kind"), blocks))


def build_scheduler(cfg: DictConfig, num_gpu_blocks: int, num_cpu_blocks: int, recorder=None,
                    workload: Workload | None = None) -> Scheduler:
    """The policies.Scheduler for this config (both backends use it; the engine passes its own
    measured block counts)."""
    return build(scheduling_config(cfg, workload), num_gpu_blocks, num_cpu_blocks, recorder)


def latency_config(cfg: DictConfig) -> LatencyConfig:
    """The latency model's typed config; a `path` (a profile) or a `dir` (of operator profiles)
    resolved against the working directory, then the repository root, and required to exist."""
    lat = section(cfg, "latency")
    config = LATENCY_MODELS.config(lat.get("name"), lat, where="latency")
    if hasattr(config, "path"):
        path = resolve_path(str(config.path))
        if not path.is_file():
            raise ValueError(f"latency.path={str(config.path)!r} is invalid: no such profile. Run "
                             "`python -m experiments.profile` on that GPU, or try "
                             "latency.path=experiments/profiles/example-synthetic.csv")
        config.path = str(path)
    if hasattr(config, "dir"):
        directory = resolve_path(str(config.dir))
        if not directory.is_dir():
            raise ValueError(f"latency.dir={str(config.dir)!r} is invalid: no such directory of operator profiles")
        config.dir = str(directory)
    return config


def latency_setup(cfg: DictConfig) -> LatencySetup:
    gpu_model_shape(cfg)  # the size's errors, named by config key
    sched = cfg.get("scheduler") or {}

    tp = tensor_parallel_size(cfg)
    sequence_parallel = parallel_config(cfg).sequence_parallel_min_rows  # checked there; null: the engine's 0
    eager_from = sequence_parallel_from(tp, sequence_parallel)

    def graph_sizes() -> tuple[list[int], list[int]]:  # the engine's CUDA-graph buckets for these limits
        from engine.device.cuda_graph import graph_batch_sizes, graph_token_sizes
        return (graph_batch_sizes(sched.max_num_seqs),
                graph_token_sizes(sched.max_num_batched_tokens, eager_from))

    def decode_splits(programs: int, slots: int, table_tokens: int) -> int:  # the engine's split-KV rule
        from kernels.decode_splits import splits_for
        from kernels.decode_tma import TmaDecodeConfig
        return splits_for(programs, table_tokens, slots, TmaDecodeConfig().min_split_tokens, ordered=True)

    return LatencySetup(model_shape(cfg), hardware(cfg), block_size(cfg), tp,
                        bool(sched.get("async_scheduling", False)), graph_sizes, decode_splits,
                        sched.get("max_model_len"), lambda: engine_all_reduce(cfg), sequence_parallel)


def build_latency(cfg: DictConfig) -> LatencyModel:
    return build_latency_model(latency_config(cfg), latency_setup(cfg))


def workload(cfg: DictConfig) -> Workload:
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} is invalid: must be an integer >= 0")
    return build_workload(section(cfg, "workload"), seed, model_shape(cfg).vocab_size)
