"""What the engine's throughput benches share (bench_throughput, lab/profile_engine_step,
lab/bench_step_parts): the run config of nano-vllm's benchmark, the device's copy bandwidth (the
floor a decode step's bytes are measured against) and a markdown table.
"""
from __future__ import annotations

import time

import pandas as pd
import torch

BASE = ["backend=engine", "model=qwen3-0.6b", "workload=nanovllm",  # nano-vllm's engine limits:
        "scheduler.max_num_batched_tokens=16384", "scheduler.max_num_seqs=512", "scheduler.max_model_len=4096",
        "progress=false", "plots=false", "blocks.kv_cache_gib=null"]  # KV pool: GPU memory


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes moved (read + write) per second by a device-to-device tensor copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    device_sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    device_sync(device)
    seconds = time.perf_counter() - start
    del src, dst
    return 2 * nbytes * iters / seconds


def markdown_table(df: pd.DataFrame) -> str:
    """A DataFrame as a markdown table (no tabulate dependency)."""
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
