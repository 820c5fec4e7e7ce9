"""Every engine setting a run config holds reaches `EngineArgs` through
`experiments.lib.engine_backend.engine_args`, the one path every entry point (run, ab, fidelity,
bench_throughput, bench_online, the lab) builds its engine from: an override that changes a config
key changes the matching field, and a new `EngineArgs` field fails here until it is mapped or
declared as not coming from the run config."""
from __future__ import annotations

import dataclasses

import pytest

from engine.engine_args import EngineArgs
from experiments.lib.engine_backend import engine_args
from experiments.lib.fidelity_spec import compose_cfg

BASE = ["backend=engine", "model=tiny-qwen3", "blocks.num_gpu_blocks=64", "backend.device=cpu", "scheduler.max_model_len=1024"]

# EngineArgs field -> (an override that changes it, the value the field must then hold).
MAPPED = {
    "model": ("model=tiny-llama", lambda a: a.model.name == "tiny-llama"),
    "dtype": ("backend.dtype=float16", lambda a: a.dtype == "float16"),
    "device": ("backend.device=cuda", lambda a: a.device == "cuda"),
    "block_manager": ("blocks=prefix", lambda a: a.block_manager == "prefix"),
    "policy": ("policy=priority", lambda a: a.policy == "priority"),
    "policy_config": ("policy=srpt", lambda a: a.policy_config == {"predictor": "max_tokens", "aging": 0.0,
                                                                   "preempt_running": True}),
    "preemption_mode": ("policy.preemption_mode=swap", lambda a: a.preemption_mode == "swap"),
    "max_num_batched_tokens": ("scheduler.max_num_batched_tokens=512", lambda a: a.max_num_batched_tokens == 512),
    "max_num_seqs": ("scheduler.max_num_seqs=7", lambda a: a.max_num_seqs == 7),
    "max_model_len": ("scheduler.max_model_len=300", lambda a: a.max_model_len == 300),
    "enable_chunked_prefill": ("scheduler.enable_chunked_prefill=false", lambda a: not a.enable_chunked_prefill),
    "async_scheduling": ("scheduler.async_scheduling=false", lambda a: not a.async_scheduling),
    "join_ahead": ("scheduler.join_ahead=false", lambda a: not a.join_ahead),
    "watermark": ("blocks.watermark=0.05", lambda a: a.watermark == 0.05),
    "block_size": ("blocks.block_size=32", lambda a: a.block_size == 32),
    "gpu_memory_utilization": ("blocks.gpu_memory_utilization=0.5", lambda a: a.gpu_memory_utilization == 0.5),
    "swap_space": ("blocks.swap_space_gib=1", lambda a: a.swap_space == 1.0),
    "num_gpu_blocks": ("blocks.num_gpu_blocks=99", lambda a: a.num_gpu_blocks == 99),
    "enforce_eager": ("backend.enforce_eager=true", lambda a: a.enforce_eager),
    "decode_kernel": ("backend.decode_kernel=packed", lambda a: a.decode_kernel == "packed"),
    "seed": ("seed=5", lambda a: a.seed == 5),
    "tensor_parallel_size": ("parallel.tensor_parallel_size=2", lambda a: a.tensor_parallel_size == 2),
    "disable_custom_all_reduce": ("parallel.disable_custom_all_reduce=true", lambda a: a.disable_custom_all_reduce),
    "custom_all_reduce_one_shot_max_bytes": ("parallel.custom_all_reduce_one_shot_max_bytes=4096",
                                             lambda a: a.custom_all_reduce_one_shot_max_bytes == 4096),
    "custom_all_reduce_max_bytes": ("parallel.custom_all_reduce_max_bytes=65536",
                                    lambda a: a.custom_all_reduce_max_bytes == 65536),
    "all_reduce_kernel": ("parallel.all_reduce_kernel=triton_fused", lambda a: a.all_reduce_kernel == "triton_fused"),
    "sequence_parallel_min_rows": ("parallel.sequence_parallel_min_rows=2048",
                                   lambda a: a.sequence_parallel_min_rows == 2048),
}
# Fields a run config does not set, and why.
NOT_FROM_CONFIG = {
    "tokenizer": "runs feed token ids; the tokenizer comes with the weights",
    "detokenize": "runs read token ids only (always False here)",
    "distributed_timeout_s": "a fault-detection deadline, not an experiment setting (EngineArgs default)",
    "max_logprobs": "a serving limit on what requests may ask for; runs ask for no logprobs",
}
# Fields mapped from the run config whose override needs a plugin no shipped config has, and the
# test that covers them.
MAPPED_ELSEWHERE = {
    "block_manager_config": "tests/project/test_extending_examples.py: a block manager with its own knob",
}


def test_every_engine_args_field_is_mapped_or_declared():
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    covered = MAPPED.keys() | NOT_FROM_CONFIG.keys() | MAPPED_ELSEWHERE.keys()
    assert fields - covered == set(), "map these fields in engine_args()"
    assert covered - fields == set(), "stale entries in this test"


@pytest.mark.parametrize("field", sorted(MAPPED))
def test_an_override_reaches_its_engine_args_field(field, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device=cuda resolves without a GPU
    override, holds = MAPPED[field]
    base = engine_args(compose_cfg(BASE))
    assert not holds(base), f"{override} is the default already: pick another value"
    args = engine_args(compose_cfg([*BASE, override]))
    assert holds(args), f"{override} did not reach EngineArgs.{field}"
    changed = {f.name for f in dataclasses.fields(EngineArgs) if getattr(args, f.name) != getattr(base, f.name)}
    assert field in changed


def test_runs_that_differ_in_scheduler_settings_share_one_engine_with_their_own_scheduler():
    from experiments.lib.engine_backend import get_engine, release_engine

    sync = engine_args(compose_cfg([*BASE, "scheduler.max_model_len=128", "scheduler.async_scheduling=false"]))
    ahead = engine_args(compose_cfg([*BASE, "scheduler.max_model_len=128", "policy=priority"]))
    try:
        first = get_engine(sync)
        assert not first.scheduler.config.async_scheduling
        second = get_engine(ahead)
        assert second is first  # model, KV cache and graphs kept
        assert second.scheduler.config.async_scheduling and second.args.policy == "priority"
    finally:
        release_engine()
