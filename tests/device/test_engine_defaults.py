"""The engine's defaults: async scheduling on, and the decode kernel "auto", which a runner resolves
when it is built (the Gluon TMA kernel on Hopper with fp16/bf16 and shapes it takes, packed
elsewhere); each can still be turned off, and a run's summary names the kernel that ran."""
from __future__ import annotations

import pytest
import torch

from engine.device.attention import attention_ops, resolve_decode_kernel
from engine.engine_args import EngineArgs
from experiments.lib.engine_backend import engine_args
from experiments.lib.fidelity_spec import compose_cfg

CUDA = torch.device("cuda", 0)
QWEN3_06B = {"head_dim": 128, "group": 2, "block_size": 16}


@pytest.mark.parametrize("capability, dtype, shape, kernel", [
    ((9, 0), torch.bfloat16, QWEN3_06B, "tma"),
    ((9, 0), torch.float16, QWEN3_06B | {"head_dim": 64, "block_size": 8}, "tma"),
    ((8, 0), torch.bfloat16, QWEN3_06B, "packed"),  # Ampere: no Gluon TMA
    ((10, 0), torch.bfloat16, QWEN3_06B, "packed"),  # not measured there
    ((9, 0), torch.float32, QWEN3_06B, "packed"),
    ((9, 0), torch.bfloat16, QWEN3_06B | {"head_dim": 96}, "packed"),
    ((9, 0), torch.bfloat16, QWEN3_06B | {"group": 32}, "packed"),
    ((9, 0), torch.bfloat16, QWEN3_06B | {"block_size": 64}, "packed"),
])
def test_auto_is_tma_on_hopper_with_half_precision_else_packed(monkeypatch, capability, dtype, shape, kernel):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_decode_kernel("auto", CUDA, dtype, **shape) == kernel


def test_auto_is_packed_on_cpu_and_named_kernels_are_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_decode_kernel("auto", torch.device("cpu"), torch.bfloat16, **QWEN3_06B) == "packed"
    for name in ("packed", "per-head", "tma"):
        assert resolve_decode_kernel(name, CUDA, torch.float32, **QWEN3_06B) == name
    with pytest.raises(ValueError, match="decode_kernel='flash' is invalid"):
        resolve_decode_kernel("flash", CUDA, torch.bfloat16, **QWEN3_06B)
    with pytest.raises(ValueError, match="decode_kernel='auto' is invalid here"):
        attention_ops("triton", torch.device("cpu"), "auto")


def test_engine_args_and_run_config_default_to_async_and_auto():
    args = EngineArgs()
    assert args.async_scheduling and args.decode_kernel == "auto"
    base = ["backend=engine", "model=tiny-qwen3", "blocks.num_gpu_blocks=64", "backend.device=cpu", "scheduler.max_model_len=1024"]
    from_cfg = engine_args(compose_cfg(base))
    assert from_cfg.async_scheduling and from_cfg.decode_kernel == "auto"
    off = engine_args(compose_cfg([*base, "scheduler.async_scheduling=false", "backend.decode_kernel=packed"]))
    assert not off.async_scheduling and off.decode_kernel == "packed"
    assert compose_cfg([]).scheduler.async_scheduling  # the simulator's default run schedules ahead too
