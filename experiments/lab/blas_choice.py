"""cuBLAS against cuBLASLt for the engine's decode GEMMs (bf16, no bias), each replayed from a CUDA
graph in one process (`torch.backends.cuda.preferred_blas_library`), at Qwen3-0.6B's and Qwen3-8B's
shapes (TP=1 and the TP=2 shard) and decode batches of 64, 176 and 256 rows. Needs a CUDA GPU.

    python -m experiments.lab.blas_choice
"""
from __future__ import annotations

import torch

# name -> (K, N) of the weight as the engine multiplies it (x [M, K] @ W^T, W [N, K])
SHAPES = {"0.6b qkv": (1024, 4096), "0.6b o_proj": (2048, 1024), "0.6b gate_up": (1024, 6144),
          "0.6b down": (3072, 1024), "8b qkv tp1": (4096, 6144), "8b o_proj tp1": (4096, 4096),
          "8b gate_up tp1": (4096, 24576), "8b down tp1": (12288, 4096), "8b o_proj tp2": (2048, 4096),
          "8b down tp2": (6144, 4096), "8b gate_up tp2": (4096, 12288)}
ROWS = (64, 176, 256)
CALLS_PER_REPLAY, REPLAYS = 20, 50


def graph_us(fn) -> float:
    """Microseconds per call of `fn`, captured CALLS_PER_REPLAY times in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_REPLAY):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS_PER_REPLAY)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("experiments.lab.blas_choice needs a CUDA GPU (none is visible)")
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            us = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                us[lib] = graph_us(lambda x=x, w=w, out=out: torch.mm(x, w.t(), out=out))
            print(f"{name:16s} m={m:4d} cublas {us['cublas']:7.2f} us  cublaslt {us['cublaslt']:7.2f} us  "
                  f"lt/cublas {us['cublaslt'] / us['cublas']:.3f}", flush=True)


if __name__ == "__main__":
    main()
