"""Time the engine's operators over an `OperatorGrid` (rows of sim/latency/operator_file.py).

Every operator is the engine's own code path: GEMMs through `torch.nn.functional.linear` (as the
model's `nn.Linear`s), attention through `engine.device.attention.attention_ops` (the Triton launchers
with the decode kernel the engine resolves for that shape, or `kernels.reference` on the CPU),
the elementwise pieces from `engine.models.ops.fused_ops` (torch.compile'd on CUDA, as the engine),
the fused q/k norm + RoPE + KV write kernel, `kernels.sample_gumbel`, and the block copies and
swaps of `kernels`.

On CUDA a call is timed by replaying a CUDA graph of many calls (experiments/lib/kernel_timing.py:
back to back as in the engine's graphs; GEMM weights and attention problems rotate over copies
3x the L2 so that each call reads them from DRAM, as each of the engine's layers reads its own); swaps and graph launches, which involve the host, by wall clock
around a device sync. On the CPU every call is timed by wall clock (median).
"""
from __future__ import annotations

import inspect
import math
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from experiments.lib.profiling.operator_grid import OperatorGrid
from policies.block_table_width import table_tokens

Row = dict[str, float | str]


class Timer:
    """Median seconds of one call on `device` (CUDA graphs on a GPU, wall clock on the CPU)."""

    def __init__(self, device: torch.device, target_ms: float) -> None:
        self.device, self.target_ms = device, target_ms

    def kernel(self, fns: list[Callable[[], object]]) -> float:
        if self.device.type == "cuda":
            from experiments.lib.kernel_timing import graph_ms
            return graph_ms(fns, self.target_ms) / 1e3
        return self.wall(fns)

    def wall(self, fns: list[Callable[[], object]]) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for fn in fns:
            fn()
        sync()
        times: list[float] = []
        deadline = time.perf_counter() + 20 * self.target_ms / 1e3
        while len(times) < 5 or (len(times) < 50 and time.perf_counter() < deadline):
            fn = fns[len(times) % len(fns)]
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _copies(device: torch.device, nbytes: int, most: int = 64) -> int:
    """Copies of a problem to rotate over so that each call reads from DRAM, as the engine's
    layers each read their own weights and KV (1 on the CPU)."""
    if device.type != "cuda":
        return 1
    from experiments.lib.kernel_timing import copies_for
    return copies_for(nbytes, max_copies=most)


def gemm_rows(grid: OperatorGrid, timer: Timer, dtype: torch.dtype) -> Iterator[Row]:
    dev, size = timer.device, dtype.itemsize
    for k, n, ms in grid.gemm_cells(size):
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02
                   for _ in range(_copies(dev, k * n * size))]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            t = timer.kernel([lambda w=w, x=x: F.linear(x, w) for w in weights])
            yield {"op": "gemm", "m": m, "k": k, "n": n, "time_s": t}
        del weights


def _widen(tables: torch.Tensor, width: int) -> torch.Tensor:
    """Block tables padded to `width` columns (block 0: never read past a context), as the engine's
    CUDA graphs hold them (max_model_len's blocks at `table_width` columns); the decode kernels size
    their split-KV grid from the width."""
    if tables.shape[1] >= width:
        return tables
    pad = torch.zeros(tables.shape[0], width - tables.shape[1], dtype=tables.dtype, device=tables.device)
    return torch.cat([tables, pad], dim=1)


def attention_rows(grid: OperatorGrid, timer: Timer, dtype: torch.dtype, decode_kernel: str,
                   max_model_len: int) -> Iterator[Row]:
    from engine.device.attention import attention_ops, resolve_decode_kernel
    from kernels.inputs import random_paged_problem
    dev, bs = timer.device, grid.block_size
    for d in grid.head_dims:
        for kv in grid.kv_heads:
            for g in grid.groups:
                hq = kv * g
                resolved = resolve_decode_kernel(decode_kernel, dev, dtype, d, g, bs)
                ops = attention_ops("auto", dev, resolved if dev.type == "cuda" else "packed")
                common = {"num_heads": hq, "num_kv_heads": kv, "head_dim": d}
                for b in grid.decode_seqs:
                    for c in grid.decode_context:
                        problems = [random_paged_problem([c] * b, None, hq, kv, d, bs, dtype, device=dev, seed=i)
                                    for i in range(_copies(dev, 4 * b * c * kv * d * dtype.itemsize, 8))]
                        for p in problems:
                            p.block_tables = _widen(p.block_tables, table_tokens(max_model_len, bs) // bs)
                        # The engine launches its decodes longest first (`decode_order`), which the
                        # split heuristic takes into account: here every context is equal.
                        order = ({"order": torch.arange(b, dtype=torch.int32, device=dev)}
                                 if "order" in inspect.signature(ops.paged_decode_attention).parameters else {})
                        t = timer.kernel([lambda p=p, ops=ops, order=order: ops.paged_decode_attention(
                            *p.decode_args(), **order) for p in problems])
                        yield {"op": "decode_attention", "m": b, "context": c, **common, "time_s": t}
                for q in grid.prefill_tokens:
                    for c in grid.prefill_context:
                        problems = [random_paged_problem([c + q], [q], hq, kv, d, bs, dtype, device=dev, seed=i)
                                    for i in range(_copies(dev, 4 * (c + q) * kv * d * dtype.itemsize, 8))]
                        t = timer.kernel([lambda p=p, q=q, ops=ops: ops.paged_prefill_attention(*p.prefill_args(), q)
                                          for p in problems])
                        yield {"op": "prefill_attention", "m": q, "context": c, **common, "time_s": t}
                yield from _qk_rope_rows(grid, timer, dtype, ops, hq, kv, d)


def _qk_rope_rows(grid: OperatorGrid, timer: Timer, dtype: torch.dtype, ops, hq: int, kv: int,
                  d: int) -> Iterator[Row]:
    """The fused q/k RMSNorm + RoPE + KV write (Triton), or on the CPU its unfused pieces."""
    from engine.models.ops import fused_ops
    from kernels import reference
    dev, bs = timer.device, grid.block_size
    fns = fused_ops(dev.type == "cuda", 1e-6)
    qw, kw = torch.ones(d, device=dev, dtype=dtype), torch.ones(d, device=dev, dtype=dtype)
    for m in grid.tokens:
        blocks = -(-m // bs) + 1
        k_cache = torch.zeros(blocks, bs, kv, d, device=dev, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        qkv = torch.randn(m, (hq + 2 * kv) * d, device=dev, dtype=dtype)
        rope = torch.randn(m, 2, d, device=dev, dtype=dtype)
        slots = torch.arange(m, device=dev, dtype=torch.int64)
        fused = getattr(ops, "qk_norm_rope_write", None)
        if fused is not None:
            def call(qkv=qkv, rope=rope, k_cache=k_cache, v_cache=v_cache, slots=slots, fused=fused):
                return fused(qkv, hq, qw, kw, 1e-6, rope, k_cache, v_cache, slots)
        else:
            def call(qkv=qkv, rope=rope, k_cache=k_cache, v_cache=v_cache, slots=slots, m=m):
                q, k, v = qkv.view(m, hq + 2 * kv, d).split([hq, kv, kv], dim=1)
                q, k = fns.qk_norm_rope(q, k, qw, kw, rope)
                reference.write_kv_cache(k, v, k_cache, v_cache, slots)
        t = timer.kernel([call])
        yield {"op": "qk_rope_write", "m": m, "num_heads": hq, "num_kv_heads": kv, "head_dim": d, "time_s": t}


def elementwise_rows(grid: OperatorGrid, timer: Timer, dtype: torch.dtype) -> Iterator[Row]:
    import kernels
    from engine.models.ops import fused_ops
    dev = timer.device
    for n in grid.widths:
        # As in the engine: the norm weight is an nn.Parameter, whose shape torch.compile takes as
        # static (a plain tensor's width would be symbolic, compiling a looped reduction whose time
        # grows with the width at any row count), and each width compiles afresh (the recompile
        # limit would otherwise drop the later widths to eager).
        torch._dynamo.reset()
        fns = fused_ops(dev.type == "cuda", 1e-6)
        weight = torch.nn.Parameter(torch.ones(n, device=dev, dtype=dtype), requires_grad=False)
        table = torch.randn(4096, n, device=dev, dtype=dtype)
        for m in grid.tokens:
            x, r = torch.randn(m, n, device=dev, dtype=dtype), torch.randn(m, n, device=dev, dtype=dtype)
            gate_up = torch.randn(m, 2 * n, device=dev, dtype=dtype)
            ids = torch.randint(0, 4096, (m,), device=dev)
            calls = {"rms_norm": lambda x=x, w=weight, f=fns: f.rms_norm(x, w),
                     "add_rms_norm": lambda x=x, r=r, w=weight, f=fns: f.add_rms_norm(x, r, w),
                     "silu_and_mul": lambda g=gate_up, f=fns: f.silu_and_mul(g),
                     "embedding": lambda ids=ids, t=table: F.embedding(ids, t)}
            for op, call in calls.items():
                yield {"op": op, "m": m, "n": n, "time_s": timer.kernel([call])}
    for n in grid.vocab:
        for m in grid.sample_rows:
            logits = torch.randn(m, n, device=dev, dtype=dtype)
            temps = torch.ones(m, device=dev)
            t = timer.kernel([lambda lg=logits, tp=temps: kernels.sample_gumbel(lg, tp, 0)])
            yield {"op": "sampler", "m": m, "n": n, "time_s": t}


def block_rows(grid: OperatorGrid, timer: Timer, dtype: torch.dtype) -> Iterator[Row]:
    """KV block copies on the GPU and swaps to/from pinned host memory, in 32 KiB blocks (one
    layer's K or V block of 16 tokens x 8 heads x 128 dims in bf16)."""
    import kernels
    dev = timer.device
    block = (16, 8, 64 if dtype.itemsize == 4 else 128)
    block_bytes = math.prod(block) * dtype.itemsize
    for op, sizes in (("copy_blocks", grid.copy_bytes), ("swap_out", grid.swap_bytes), ("swap_in", grid.swap_bytes)):
        for nbytes in sizes:
            n = max(1, nbytes // (2 * block_bytes))  # K and V
            gpu = [torch.zeros(2 * n, *block, device=dev, dtype=dtype) for _ in range(2)]
            pairs = torch.stack([torch.arange(n), torch.arange(n, 2 * n)], 1)
            if op == "copy_blocks":
                pairs = pairs.to(dev)
                t = timer.kernel([lambda g=gpu, p=pairs: kernels.copy_blocks([g[0]], [g[1]], p)])
            else:
                host = [torch.zeros(2 * n, *block, dtype=dtype, pin_memory=dev.type == "cuda") for _ in range(2)]
                src, dst = (gpu, host) if op == "swap_out" else (host, gpu)
                pairs[:, 1] = pairs[:, 0]
                t = timer.wall([lambda s=src, d=dst, p=pairs: kernels.swap_layers(s, d, p)])
            yield {"op": op, "bytes": 2 * n * block_bytes, "time_s": t}


def launch_rows(grid: OperatorGrid, timer: Timer) -> Iterator[Row]:
    """Launching a CUDA graph of m tiny kernels and waiting for it (on the CPU: m tiny ops)."""
    dev = timer.device
    x = torch.zeros(1, device=dev)
    for m in grid.launch_kernels:
        if dev.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                x.add_(1)
                stream.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(m):
                        x.add_(1)
            t = timer.wall([graph.replay])
        else:
            t = timer.wall([lambda m=m: [x.add_(1) for _ in range(m)]])
        yield {"op": "graph_launch", "m": m, "time_s": t}


def compute_rows(grid: OperatorGrid, device: torch.device, dtype: torch.dtype, decode_kernel: str,
                 max_model_len: int, log: Callable[[str], None]) -> list[Row]:
    """Every compute operator's rows; `log` hears each family's count and seconds."""
    torch.manual_seed(0)
    timer = Timer(device, grid.target_ms)
    rows: list[Row] = []
    families = (("gemm", lambda: gemm_rows(grid, timer, dtype)),
                ("attention", lambda: attention_rows(grid, timer, dtype, decode_kernel, max_model_len)),
                ("elementwise", lambda: elementwise_rows(grid, timer, dtype)),
                ("blocks", lambda: block_rows(grid, timer, dtype)),
                ("launch", lambda: launch_rows(grid, timer)))
    for name, family in families:
        start, before = time.perf_counter(), len(rows)
        rows.extend(family())
        log(f"{name}: {len(rows) - before} rows in {time.perf_counter() - start:.1f}s")
    return rows
