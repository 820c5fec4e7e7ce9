"""Which GEMM runs a model's small-N linear layers: cuBLAS through `F.linear` ("torch", the default)
or the split-K Triton kernel (kernels/small_gemm.py) at decode sizes ("splitk").

A layer qualifies by its shape, not its name: a plain `nn.Linear` that reduces over at least as
many inputs as it has outputs, with few enough outputs that the kernel's narrowest tiles leave SMs
idle (Qwen3-0.6B's o_proj and down_proj; Qwen3-8B's too). `use_small_gemm` turns those layers into
`SplitKLinear`s in place (same parameters, same state-dict names); each call then runs the kernel
when `kernels.small_gemm.pick_config` splits its K (decode-size batches) and `F.linear` otherwise.
Under tensor parallelism the row-parallel o_proj and down_proj are not `nn.Linear`s and keep their
GEMM; a column-parallel shard that qualifies takes the kernel (Qwen3-8B's q/k/v at TP=2: N 3,072, K 4,096).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import check_small_gemm
from kernels.small_gemm import DEFAULT_NUM_SMS, new_counters, pick_config, splitk_linear


def qualifies(out_features: int, in_features: int, num_sms: int) -> bool:
    """A product whose output columns, in the kernel's 64-wide tiles, fit one wave of the SMs and
    whose reduction is at least as long as its output row."""
    return in_features >= out_features and out_features <= 64 * num_sms


class SplitKLinear(nn.Linear):
    """`nn.Linear` whose decode-size products (2-D inputs of at most `kernels.small_gemm.M_MAX`
    rows that the kernel splits) go through the split-K kernel; other calls are `F.linear`'s."""

    counters: torch.Tensor
    num_sms: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        config = pick_config(x.shape[0], self.out_features, self.in_features, self.num_sms) if x.dim() == 2 else None
        if config is None:
            return F.linear(x, self.weight, self.bias)
        return splitk_linear(x, self.weight, self.bias, self.counters, config)


def use_small_gemm(model: nn.Module, small_gemm: str) -> int:
    """Route `model`'s qualifying `nn.Linear` layers through `small_gemm`'s GEMM; returns how many
    layers changed (0 for "torch"). The model's parameters must be on their device already."""
    check_small_gemm(small_gemm)
    if small_gemm == "torch":
        return 0
    device = next(model.parameters()).device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"small_gemm={small_gemm!r} is invalid on {device}: the Triton kernel needs CUDA "
                         "(or TRITON_INTERPRET=1 on a CPU); use 'torch'")
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
               else DEFAULT_NUM_SMS)
    layers = [m for m in model.modules()
              if type(m) is nn.Linear and qualifies(m.out_features, m.in_features, num_sms)]
    if not layers:
        return 0
    counters = new_counters(max(m.out_features for m in layers), device)  # one set: one stream runs the layers
    for layer in layers:
        layer.__class__ = SplitKLinear
        layer.counters, layer.num_sms = counters, num_sms
    return len(layers)
