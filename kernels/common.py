"""Small helpers shared by the kernel launchers."""

import functools
import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET=1 set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast_operands(dtype: torch.dtype) -> bool:
    """Whether kernels cast loaded tiles to fp32 before tl.dot.  Always in the interpreter (it
    mis-computes bf16 and its fp16 dot is slow), and for fp32 caches; on the GPU fp16/bf16 tiles
    go to the tensor cores as they are, accumulating in fp32."""
    return interpreting() or dtype == torch.float32


def dot_precision(upcast: bool) -> str:
    """fp32 tiles (upcast) get exact fp32 products, not tf32; fp16/bf16 ignore the setting."""
    return "ieee" if upcast else "tf32"


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _max_shared_memory(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def max_shared_memory(device: torch.device) -> int:
    """Shared memory one program may use (bytes), as Triton's launcher checks it."""
    return _max_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


def device_sms(device: torch.device) -> int:
    """Multiprocessor count for split heuristics; a small stand-in on the CPU."""
    if device.type != "cuda":
        return 4
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def block_dim(head_dim: int) -> int:
    """Padded head_dim tile: a power of two, at least 16 (the tl.dot minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}
LOG2E = 1.4426950408889634
