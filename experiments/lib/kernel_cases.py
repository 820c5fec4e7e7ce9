"""Problem builders, block-op timings and compiler reports for experiments/bench_kernels.py."""

import torch
from triton.testing import do_bench

from experiments.lib.kernel_timing import wall_ms
from kernels import copy as block_copy
from kernels import decode, decode_packed, decode_splits, prefill, reference
from kernels.cache_write import write_kv_cache
from kernels.inputs import random_paged_problem


def decode_problem(
    batch: int, ctx: int, hq: int, hkv: int, d: int, bs: int, seed: int = 0, device: str = "cuda"
):
    """A uniform-length paged decode problem and the same K/V contiguous as [B, Hkv, L, D]."""
    prob = random_paged_problem([ctx] * batch, None, hq, hkv, d, bs, torch.bfloat16, device=device, seed=seed)
    nblk = (ctx + bs - 1) // bs
    idx = prob.block_tables[:, :nblk].long()

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        return cache[idx].view(batch, nblk * bs, hkv, d)[:, :ctx].permute(0, 2, 1, 3).contiguous()

    return prob, contiguous(prob.k_cache), contiguous(prob.v_cache)


def ragged_decode_problem(
    batch: int, low: int, high: int, hq: int, hkv: int, d: int, bs: int, seed: int = 0, device: str = "cuda"
):
    """A decode problem with context lengths drawn uniformly from [low, high] (fixed seed)."""
    lens = torch.randint(low, high + 1, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
    return random_paged_problem(lens, None, hq, hkv, d, bs, torch.bfloat16, device=device, seed=seed)


def prefill_problem(
    new: int, prefix: int, hq: int, hkv: int, d: int, bs: int, seed: int = 0, device: str = "cuda"
):
    """One prompt of `new` tokens after `prefix` cached ones; plus q/k/v as [1, H, T, D] for SDPA."""
    prob = random_paged_problem(
        [prefix + new], [new], hq, hkv, d, bs, torch.bfloat16, device=device, seed=seed
    )
    nblk = (prefix + new + bs - 1) // bs
    idx = prob.block_tables[0, :nblk].long()

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        return cache[idx].reshape(nblk * bs, hkv, d)[: prefix + new].transpose(0, 1).unsqueeze(0).contiguous()

    q4 = prob.q.transpose(0, 1).unsqueeze(0).contiguous()
    return prob, q4, contiguous(prob.k_cache), contiguous(prob.v_cache)


SHAPE, BLOCK_BYTES = (16, 8, 128), 16 * 8 * 128 * 2  # one Qwen3-0.6B KV block per layer, bf16


def _op(
    kernel: str, shape: str, variant: str, ms: float, nbytes: int, ceiling: float, ref_ms: float | None = None
) -> dict:
    return {
        "kernel": kernel,
        "shape": shape,
        "variant": variant,
        "ms": ms,
        "metric": nbytes / ms / 1e6,
        "unit": "GB/s",
        "ceiling": ceiling,
        "ref_ms": ref_ms,
    }


def _write_kv_row(tokens: int, copy_bw: float) -> dict:
    k_cache, v_cache = (torch.randn(65536, *SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(tokens, *SHAPE[1:], device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(65536 * 16, device="cuda")[:tokens]
    ms = do_bench(lambda: write_kv_cache(k, v, k_cache, v_cache, slots), return_mode="median")
    ref_ms = do_bench(lambda: reference.write_kv_cache(k, v, k_cache, v_cache, slots), return_mode="median")
    return _op("write_kv", f"T{tokens}", "triton", ms, 2 * 2 * k.nbytes, copy_bw, ref_ms)


def _copy_blocks_row(copy_bw: float, layers: int = 28, num_pairs: int = 256) -> dict:
    k_caches = [torch.randn(4096, *SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    v_caches = [torch.randn(4096, *SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    perm = torch.randperm(4096)
    pairs = torch.stack([perm[:num_pairs], perm[num_pairs : 2 * num_pairs]], 1).cuda()
    ms = do_bench(lambda: block_copy.copy_blocks(k_caches, v_caches, pairs), return_mode="median")
    ref_ms = do_bench(lambda: reference.copy_blocks(k_caches, v_caches, pairs), return_mode="median")
    return _op(
        "copy_blocks",
        f"{layers}L x {num_pairs} blocks",
        "triton",
        ms,
        2 * 2 * layers * num_pairs * BLOCK_BYTES,
        copy_bw,
        ref_ms,
    )


def _swap_row(
    method: str, direction: str, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, link_gbps: float
) -> dict:
    ms = wall_ms(lambda: block_copy.swap_blocks(src, dst, pairs, method=method))
    return _op(
        f"swap_{direction}",
        f"{pairs.shape[0]} blocks x {BLOCK_BYTES >> 10} KiB",
        method,
        ms,
        pairs.shape[0] * BLOCK_BYTES,
        link_gbps,
    )


def _swap_rows(num_pairs: int = 1024) -> list[dict]:
    """Swap one layer's blocks GPU <-> pinned CPU, against a plain pinned copy of the same bytes."""
    gpu = torch.randn(4096, *SHAPE, device="cuda", dtype=torch.bfloat16)
    host = torch.randn(4096, *SHAPE, dtype=torch.bfloat16).pin_memory()
    nbytes = num_pairs * BLOCK_BYTES
    dev_buf = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    host_buf = torch.empty(nbytes // 2, dtype=torch.bfloat16).pin_memory()
    out_ms = wall_ms(lambda: host_buf.copy_(dev_buf, non_blocking=True))
    in_ms = wall_ms(lambda: dev_buf.copy_(host_buf, non_blocking=True))
    link = {"out": nbytes / out_ms / 1e6, "in": nbytes / in_ms / 1e6}
    rows = [
        _op("link_out", f"{nbytes >> 20} MiB contiguous", "pinned copy_", out_ms, nbytes, link["out"]),
        _op("link_in", f"{nbytes >> 20} MiB contiguous", "pinned copy_", in_ms, nbytes, link["in"]),
    ]
    gen = torch.Generator().manual_seed(0)
    pairs = torch.stack(
        [torch.randperm(4096, generator=gen)[:num_pairs], torch.randperm(4096, generator=gen)[:num_pairs]], 1
    )
    for method in ("kernel", "torch"):
        rows.append(_swap_row(method, "out", gpu, host, pairs, link["out"]))
        rows.append(_swap_row(method, "in", host, gpu, pairs, link["in"]))
    return rows


def block_ops_rows(copy_bw: float) -> list[dict]:
    """KV write, copy-on-write across 28 layers and swap GPU <-> pinned CPU (Qwen3-0.6B blocks)."""
    return [
        _write_kv_row(256, copy_bw),
        _write_kv_row(8192, copy_bw),
        _copy_blocks_row(copy_bw),
        *_swap_rows(),
    ]


def kernel_report() -> None:
    """Registers, spills, shared memory and key SASS instruction counts of every compiled kernel."""
    for name, fn in (
        ("decode", decode._decode_kernel),
        ("decode_reduce", decode_splits.decode_reduce_kernel),
        ("decode_packed", decode_packed.decode_packed_kernel),
        ("decode_packed_merge", decode_packed.decode_packed_merge_kernel),
        ("prefill", prefill._prefill_kernel),
        ("copy", block_copy._copy_blocks_kernel),
    ):
        try:
            for cache in fn.device_caches.values():
                for compiled in cache[0].values():
                    compiled._init_handles()
                    meta = compiled.metadata
                    sass = compiled.asm["sass"]  # disassembled on first access
                    counts = {
                        op: sass.count(op) for op in ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDG.E.128")
                    }
                    print(
                        f"[ptxas] {name}: warps={meta.num_warps} stages={meta.num_stages} "
                        f"regs={compiled.n_regs} spills={compiled.n_spills} smem={meta.shared} sass={counts}"
                    )
        except Exception as exc:  # noqa: BLE001  (introspection is best-effort across Triton versions)
            print(f"[ptxas] {name}: unavailable ({type(exc).__name__}: {exc})")
