"""The simulated GPU's KV pools from a run config's `blocks` section, as vLLM sizes them: a GPU
pool set in blocks (`num_gpu_blocks`), in GiB (`kv_cache_gib`) or from the memory the weights and a
max-size step's activations leave (`gpu_memory_utilization`), and a CPU pool for swaps.

Each pool is checked as the engine would start with it: one set explicitly must fit in the GPU's
memory beside its share of the weights (at the run's tensor-parallel size) and the activations,
and every pool must hold one `scheduler.max_model_len` sequence
(policies/kv_pool_size.py `check_holds_one_sequence`, the engine's start-up rule). Errors name
the key, its value and the bound that holds.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from experiments.lib import config_parts as parts
from policies.blocks.base import blocks_for_tokens
from policies.build import scheduler_config
from policies.kv_pool_size import blocks_memory_utilization, check_holds_one_sequence, check_num_gpu_blocks
from policies.model_shape import resolve_max_model_len
from policies.request import is_int
from policies.scheduler_config import SchedulerConfig
from sim.latency import Hardware, ModelShape

MAX_LEN_KEY = "scheduler.max_model_len"


def kv_block_counts(cfg: DictConfig) -> tuple[int, int]:
    """(num_gpu_blocks, num_cpu_blocks) for the simulated GPU, each checked (the module's rules)."""
    b = parts.section(cfg, "blocks")
    model, hw = parts.gpu_model_shape(cfg), parts.hardware(cfg)  # per GPU: its share of weights and KV
    # checked when set, used or not, and needed where the pool has no size of its own (the engine's rule)
    util = blocks_memory_utilization(b)
    size = parts.block_size(cfg)
    block_bytes = model.kv_bytes_per_token * size
    sched = scheduler_config(parts.section(cfg, "scheduler"))  # its limits checked before they size anything
    taken = model.weight_bytes + activation_bytes(model, sched)
    gpu = explicit_gpu_blocks(cfg, block_bytes)
    if gpu is not None:
        in_blocks = b.get("num_gpu_blocks") is not None
        _check_fits_memory(cfg, model, hw, taken, "num_gpu_blocks" if in_blocks else "kv_cache_gib", gpu * block_bytes,
                           block_bytes if in_blocks else None)
    else:
        budget = hw.memory_bytes * util - taken
        gpu = int(budget // block_bytes)
        if gpu < 1:
            raise ValueError(f"blocks.gpu_memory_utilization={util!r} is invalid: {hw.name} memory x {util} "
                             f"leaves {budget / 2**30:.2f} GiB for KV after weights and activations: no block fits")
        max_len = max_model_len(cfg)
        one_sequence = blocks_for_tokens(max_len, size) * block_bytes  # the least pool a run starts with
        least = _rounded_up((taken + one_sequence) / hw.memory_bytes)
        check_holds_one_sequence(gpu, size, max_len, "blocks.gpu_memory_utilization", util,
                                 least if least <= 1 else None, MAX_LEN_KEY)
    if b.get("num_cpu_blocks") is not None:
        cpu = _int_at_least(b, "num_cpu_blocks", 0)
    else:
        cpu = int(_gib(b, "swap_space_gib", allow_zero=True) * 2**30 // block_bytes)
    return gpu, cpu


def explicit_gpu_blocks(cfg: DictConfig, block_bytes: int) -> int | None:
    """The GPU pool in blocks of `block_bytes` (the engine's, or the simulated GPU's) that
    `blocks.num_gpu_blocks` or else `blocks.kv_cache_gib` sets, checked to hold one max_model_len
    sequence; None where neither is set (the pool is sized from GPU memory)."""
    b, size = parts.section(cfg, "blocks"), parts.block_size(cfg)
    if b.get("num_gpu_blocks") is not None:
        gpu = _int_at_least(b, "num_gpu_blocks", 1)
        check_num_gpu_blocks(gpu, size, max_model_len(cfg), "blocks.num_gpu_blocks", MAX_LEN_KEY)
        return gpu
    if b.get("kv_cache_gib") is None:
        return None
    gpu = int(_gib(b, "kv_cache_gib", allow_zero=False) * 2**30 // block_bytes)
    if gpu < 1:
        raise ValueError(f"blocks.kv_cache_gib={b['kv_cache_gib']!r} is invalid: it holds no KV block of {block_bytes} "
                         f"bytes (model={parts.section(cfg, 'model').get('name')}, block_size={size})")
    max_len = max_model_len(cfg)
    check_holds_one_sequence(gpu, size, max_len, "blocks.kv_cache_gib", b["kv_cache_gib"],
                             _rounded_up(blocks_for_tokens(max_len, size) * block_bytes / 2**30), MAX_LEN_KEY)
    return gpu


def max_model_len(cfg: DictConfig) -> int:
    """`scheduler.max_model_len`, or the model's positions where it is null, and at most those
    (`resolve_max_model_len`, the engine's rule)."""
    value, model = parts.section(cfg, "scheduler").get("max_model_len"), parts.model_shape(cfg)
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"{MAX_LEN_KEY}={value!r} is invalid: must be an integer >= 1")
    return resolve_max_model_len(value, model.max_position_embeddings, MAX_LEN_KEY, model.name)


def activation_bytes(model: ModelShape, sched: SchedulerConfig) -> int:
    """Peak activations of one max-size forward on one GPU (vLLM measures this with a profiling run)."""
    return (sched.max_num_batched_tokens * (4 * model.hidden_size + 2 * model.intermediate_size)
            * model.dtype_bytes + sched.max_num_seqs * model.vocab_size * 4)


def _check_fits_memory(cfg: DictConfig, model: ModelShape, hw: Hardware, taken: float, key: str,
                       pool_bytes: float, block_bytes: int | None) -> None:
    """A pool sized by `blocks.<key>` must fit in the GPU's memory beside the `taken` bytes (its share
    of the weights and a max-size step's activations); `block_bytes`: the key counts blocks of that
    many bytes (None: GiB)."""
    room = hw.memory_bytes - taken
    if pool_bytes <= room:
        return
    if room <= 0:
        fix = "raise parallel.tensor_parallel_size, or pick hardware with more memory"
    else:
        most = int(room // block_bytes) if block_bytes else math.floor(room / 2**30 * 1000) / 1000
        fix = f"set it to at most {most}"
    weights, activations = model.weight_bytes / 2**30, (taken - model.weight_bytes) / 2**30
    raise ValueError(f"blocks.{key}={parts.section(cfg, 'blocks')[key]!r} is invalid: model={model.name}'s weights "
                     f"({weights:.2f} GiB per GPU at parallel.tensor_parallel_size={parts.tensor_parallel_size(cfg)}) "
                     f"and activations ({activations:.2f} GiB) with a KV pool of {pool_bytes / 2**30:.2f} GiB exceed "
                     f"hardware {hw.name}'s {hw.memory_gib:g} GiB of memory: {fix}")


def _rounded_up(x: float) -> float:
    """`x` rounded up to 3 decimals: the least value that holds, as a message prints it."""
    return math.ceil(x * 1000) / 1000


def _int_at_least(b: Mapping[str, Any], key: str, low: int) -> int:
    v = b.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"blocks.{key}={v!r} is invalid: must be an integer >= {low}")
    return v


def _gib(b: Mapping[str, Any], key: str, allow_zero: bool) -> float:
    v = b.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"blocks.{key}={v!r} is invalid: must be a number {'>=' if allow_zero else '>'} 0 (GiB)")
    return float(v)
