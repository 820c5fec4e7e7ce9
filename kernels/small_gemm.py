"""Split-K GEMM for decode-size products with few output columns: y = x W^T (+ b), x [M, K] with M
at most `M_MAX` rows, W [N, K] a bf16/fp16/fp32 weight, read once from DRAM.

Why: in a decode step of Qwen3-0.6B the o_proj and down_proj GEMMs (N = 1,024 outputs, K = 2,048
and 3,072, M = the batch) leave SMs idle: cuBLAS tiles the [M, N] output into ~96 tiles for 132
SMs and each loops over all of K. Here every output tile's K range is cut into `splits` slices, one
program each, so that the grid holds about `PROGRAMS_PER_SM` programs per SM
(`pick_config`); each program keeps its float32 partial tile in registers.

Reduction, in the same kernel (serial split-K "fix-up"): every program stores its partial tile to
a float32 workspace [splits, M, N], then takes a ticket from its tile's counter (an atomic add);
the program holding the last ticket adds the tile's partials in split order 0, 1, ..., splits-1
(its own from registers, bit-equal to the stored copy), adds the bias, rounds once to the output
dtype, stores, and puts the counter back to 0. The counters are a persistent int32 tensor that
every call leaves at zero, so the launch is CUDA-graph capturable (no memset node) and the sum's
order does not depend on which program finishes last: for one (M, N, K) and config the result is
deterministic. It differs from cuBLAS's at rounding level, and, as cuBLAS's, with the batch size
(the split count follows M). One launch: a second reduction kernel would add a launch of ~2 us to
a product of ~3-6 us. Calls sharing counters must not run concurrently (one stream).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

M_MAX = 512  # the most rows a decode-size product has here; larger ones are cuBLAS's
PROGRAMS_PER_SM = 2  # two resident programs per SM (each config's shared memory is under half an SM's)
MIN_SPLIT_K = 256  # the least K one split covers: below, the fix-up costs more than the split saves
DEFAULT_NUM_SMS = 132  # an H100/H200's; the interpreter and tests use it when there is no GPU
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class SplitKConfig:
    """One launch's tiles: BLOCK_M x BLOCK_N outputs per program, K in BLOCK_K steps, `splits`
    programs per output tile (1: no workspace, no fix-up)."""

    block_m: int
    block_n: int = 64
    block_k: int = 128
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value!r} is invalid: a power of two >= 16")
        if self.splits < 1:
            raise ValueError(f"splits={self.splits!r} is invalid: an integer >= 1")

    def tiles(self, m: int, n: int) -> int:
        return triton.cdiv(m, self.block_m) * triton.cdiv(n, self.block_n)

    def k_per_split(self, k: int) -> int:
        """K covered by one split, a multiple of BLOCK_K (the last split covers the rest)."""
        return triton.cdiv(triton.cdiv(k, self.splits), self.block_k) * self.block_k

    def with_splits(self, k: int, splits: int) -> SplitKConfig:
        """This tile with `splits` slices of K, fewer where BLOCK_K steps leave some slices empty."""
        per = triton.cdiv(triton.cdiv(k, max(splits, 1)), self.block_k) * self.block_k
        return SplitKConfig(self.block_m, self.block_n, self.block_k, triton.cdiv(k, per), self.num_warps,
                            self.num_stages)


# Tiles by decode batch (rows up to the key). Shared memory per program, (BM + BN) * BK * 2 bytes *
# stages, is 40-96 KB and registers at most 144 a thread (sm_90 builds,
# tests/kernel/test_small_gemm_build.py), so two programs fit one SM. BLOCK_M 64 takes Hopper's
# wgmma, 16 and 32 mma.sync. (128 x 64 tiles need 8 warps of 144 registers: one program an SM.)
TILES: dict[int, SplitKConfig] = {
    16: SplitKConfig(16, 64, 128, num_stages=3),
    32: SplitKConfig(32, 64, 128, num_stages=3),
    M_MAX: SplitKConfig(64, 64, 128, num_stages=3),
}


def pick_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS) -> SplitKConfig | None:
    """The config for an [m, k] x [k, n] product, or None where the split kernel has nothing to
    add (more rows than M_MAX, or output tiles enough to fill the SMs without splitting K)."""
    if not 0 < m <= M_MAX:
        return None
    tile = next(cfg for rows, cfg in TILES.items() if m <= rows)
    splits = min(PROGRAMS_PER_SM * num_sms // tile.tiles(m, n), k // MIN_SPLIT_K)
    if splits < 2:
        return None
    return tile.with_splits(k, splits)


def max_tiles(n: int) -> int:
    """The most output tiles (counters) a launch of N columns uses, over every M up to M_MAX."""
    return max(cfg.tiles(rows, n) for rows, cfg in TILES.items())


@triton.jit(do_not_specialize=["M"])  # one build for every batch size (rows are loaded modulo M)
def _splitk_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split, splits, stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M and columns past N load rows modulo M / N (no load masks); their outputs are never stored.
    x_rows = rows % M
    w_rows = cols % N
    k_start = tl.multiple_of(split * k_per_split, BLOCK_K)
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + w_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            in_k = (k - k_start + offs_k) < K
            a = tl.load(x_ptrs, mask=in_k[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if splits > 1:  # a runtime count (Triton specializes 1): one compiled kernel per tile shape
        part = part_ptr + rows[:, None] * N + cols[None, :]
        slice_size = M * N
        tl.store(part + split.to(tl.int64) * slice_size, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:  # the tile's last program: the others' partials are visible
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(splits):
                other = tl.load(part + s * slice_size, mask=mask & (split != s), other=0.0, cache_modifier=".cg")
                total += tl.where(split == s, acc, other)
            tl.atomic_xchg(count_ptr + tile, 0)
            _store_out(total, bias_ptr, out_ptr, rows, cols, mask, N, stride_om, stride_on, HAS_BIAS)
    else:
        _store_out(acc, bias_ptr, out_ptr, rows, cols, mask, N, stride_om, stride_on, HAS_BIAS)


@triton.jit
def _store_out(acc, bias_ptr, out_ptr, rows, cols, mask, N, stride_om, stride_on, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counters: torch.Tensor,
           out: torch.Tensor | None, tiles: int) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x.shape={tuple(x.shape)}, weight.shape={tuple(weight.shape)} are invalid: "
                         "x [M, K] and weight [N, K]")
    if x.dtype != weight.dtype or x.dtype not in _DTYPES:
        raise ValueError(f"x.dtype={x.dtype}, weight.dtype={weight.dtype} are invalid: equal, one of {_DTYPES}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"bias.shape={tuple(bias.shape)} is invalid: a contiguous [{weight.shape[0]}]")
    if counters.dtype != torch.int32 or counters.numel() < tiles or counters.device != x.device:
        raise ValueError(f"counters (dtype {counters.dtype}, {counters.numel()} on {counters.device}) are invalid: "
                         f"int32 zeros, at least {tiles} on {x.device} (`new_counters`)")
    if out is not None and (out.shape != (x.shape[0], weight.shape[0]) or out.dtype != x.dtype):
        raise ValueError(f"out (shape {tuple(out.shape)}, dtype {out.dtype}) is invalid: "
                         f"[{x.shape[0]}, {weight.shape[0]}] of {x.dtype}")


def new_counters(n_max: int, device: torch.device | str) -> torch.Tensor:
    """The tile counters for products of up to `n_max` columns (zeros; every call leaves them so)."""
    return torch.zeros(max_tiles(n_max), dtype=torch.int32, device=device)


def splitk_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counters: torch.Tensor,
                  config: SplitKConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype (into `out` if given), with
    `config` (`pick_config`); `counters`: `new_counters` of at least N columns on x's device."""
    m, k = x.shape[0], x.shape[-1]
    n = weight.shape[0]
    tiles = config.tiles(m, n)
    _check(x, weight, bias, counters, out, tiles)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    per = config.k_per_split(k)
    splits = triton.cdiv(k, per)
    part = torch.empty(splits * m * n if splits > 1 else 1, dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 products as torch.mm's, no TF32
    _splitk_gemm_kernel[(tiles, splits)](
        x, weight, bias if bias is not None else weight, out, part, counters,
        m, n, k, per, splits, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, HAS_BIAS=bias is not None, PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
