"""One-pass categorical sampling with per-row temperatures (the engine's fast sampling path).

Gumbel-max: token = argmax_v(logits[v] / T + G_v) with G_v = -log(-log(U_v)) and U_v uniform from
Philox (`tl.rand4x`, four uniforms per counter) is an exact draw from softmax(logits / T); a row with
T = 0 is greedy (argmax of the logits, ties to the lowest index as torch.argmax). The logits are
read once, in their own dtype (the engine's bf16 logits: half the bytes of a float32 copy): no
scaled copy, softmax, noise tensor or division pass (the torch version of the same draw moves ~10
full [rows, vocab] float32 tensors through memory). Each program reduces one chunk
of one row to its best (score, index); a second small kernel picks each row's best chunk.
"""

import torch
import triton
import triton.language as tl

CHUNK = 8192  # vocab entries per program: 256 rows x 151936 tokens -> 4864 programs
BLOCK = 1024


@triton.jit
def _consider(row_ptr, cols, col_start, col_end, u, inv_t, noisy, best_val, best_idx):
    """Fold global columns `cols` (with uniforms `u`; those outside [col_start, col_end) masked)
    into the running per-lane best (score, index)."""
    mask = (cols >= col_start) & (cols < col_end)
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-30)))
    x = tl.where(noisy, x * inv_t + gumbel, x)
    better = (x > best_val) & mask
    return tl.where(better, x, best_val), tl.where(better, cols, best_idx)


# A fresh seed every step, and temperatures that callers may pass at any offset (the engine's step
# inputs are 16-byte aligned, engine/device/batch_layout.py, others need not be): neither is
# specialized on, so one compiled kernel serves every step, the one the runner compiles at start-up.
@triton.jit(do_not_specialize=["seed", "temps_ptr", "col_start", "col_end", "first_chunk"])
def _chunk_best_kernel(
    logits_ptr,
    stride_r,
    temps_ptr,
    best_val_ptr,
    best_idx_ptr,
    seed,
    col_start,
    col_end,
    first_chunk,
    num_chunks,
    row_counters,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Philox yields four uniforms per call: one call serves four BLOCK/4-column quarters of a tile
    (one uniform per call made sampling Philox-bound, 4x the integer work). Counters are unique per
    (row, tile, lane) of the whole vocabulary: row * row_counters + tile start / 4 + lane, so a
    shard (global columns [col_start, col_end), its first at logits_ptr) draws each column's noise
    exactly as the whole row does; program `chunk` covers global chunk first_chunk + chunk."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temps_ptr + row).to(tl.float32)
    noisy = temp > 0.0
    inv_t = 1.0 / tl.where(noisy, temp, 1.0)  # no 1 / 0 evaluated for greedy rows
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    best_val = tl.full([QUARTER], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([QUARTER], 2147483647, dtype=tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_r - col_start
    counter_base = row * row_counters  # < 2**31: rows * padded vocab / 4 (checked)
    start = (first_chunk + chunk) * CHUNK
    for off in range(start, start + CHUNK, BLOCK):
        u0, u1, u2, u3 = tl.rand4x(seed, counter_base + off // 4 + lanes)
        cols = off + lanes
        best_val, best_idx = _consider(row_ptr, cols, col_start, col_end, u0, inv_t, noisy, best_val, best_idx)
        best_val, best_idx = _consider(row_ptr, cols + QUARTER, col_start, col_end, u1, inv_t, noisy, best_val,
                                       best_idx)
        best_val, best_idx = _consider(row_ptr, cols + 2 * QUARTER, col_start, col_end, u2, inv_t, noisy, best_val,
                                       best_idx)
        best_val, best_idx = _consider(row_ptr, cols + 3 * QUARTER, col_start, col_end, u3, inv_t, noisy, best_val,
                                       best_idx)
    top = tl.max(best_val, 0)
    idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), 0)
    tl.store(best_val_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, idx)


@triton.jit
def _row_best_kernel(best_val_ptr, best_idx_ptr, out_ptr, num_chunks, rows, BLOCK_C: tl.constexpr,
                     PAIRS: tl.constexpr):
    """Each row's best chunk: its column (int64 at out[row]), or with PAIRS its score at out[row]
    and its column as a float32 at out[rows + row] (float32 out)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    vals = tl.load(best_val_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    idxs = tl.load(best_idx_ptr + row * num_chunks + offs, mask=mask, other=2147483647)
    top = tl.max(vals, 0)
    idx = tl.min(tl.where(vals == top, idxs, 2147483647), 0)
    if PAIRS:
        tl.store(out_ptr + row, top)
        tl.store(out_ptr + rows + row, idx.to(tl.float32))
    else:
        tl.store(out_ptr + row, idx.to(tl.int64))


def _check(logits: torch.Tensor, temperatures: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)} is invalid: expected [rows, vocab] with a contiguous vocab dim")
    if temperatures.shape != (logits.shape[0],):
        raise ValueError(f"temperatures.shape={tuple(temperatures.shape)} is invalid: expected ({logits.shape[0]},)")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits.dtype={logits.dtype} is invalid: float32, bfloat16 or float16")


def _best(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, col_start: int, vocab: int,
          pairs: bool) -> torch.Tensor:
    """Each row's best column over the shard's columns [col_start, col_start + width) of a
    `vocab`-column row (columns past `vocab` are padding, skipped): int64 [R], or with `pairs`
    float32 [2, R] (scores, then columns)."""
    _check(logits, temperatures)
    rows, width = logits.shape
    col_end = min(col_start + width, vocab)
    if not 0 <= col_start < col_end:
        raise ValueError(f"col_start={col_start} is invalid: the shard must hold columns of a {vocab}-column row")
    if pairs:
        out = torch.empty(2, rows, dtype=torch.float32, device=logits.device)
    else:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunk = max(4, min(CHUNK, triton.next_power_of_2(vocab)))  # of the whole row: every shard's noise agrees
    block = min(BLOCK, chunk)
    row_chunks = triton.cdiv(vocab, chunk)
    if rows * row_chunks * chunk >= 2**31:  # Philox counters and row offsets are int32
        raise ValueError(f"logits of {rows} rows x a {vocab}-token vocab (padded to {row_chunks * chunk}) are "
                         "invalid: rows x padded vocab must be < 2**31")
    first_chunk = col_start // chunk
    num_chunks = triton.cdiv(col_end, chunk) - first_chunk
    best_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_best_kernel[(rows, num_chunks)](
        logits, logits.stride(0), temperatures, best_val, best_idx, seed & 0x7FFFFFFF, col_start, col_end,
        first_chunk, num_chunks, row_chunks * (chunk // 4), CHUNK=chunk, BLOCK=block, num_warps=4,
    )  # fmt: skip
    _row_best_kernel[(rows,)](best_val, best_idx, out, num_chunks, rows, BLOCK_C=triton.next_power_of_2(num_chunks),
                              PAIRS=pairs)
    return out


def sample_gumbel(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """logits [R, V] (float, last dim contiguous), temperatures [R] (0 = greedy), seed (int, the
    Philox stream) -> sampled token ids [R] int64. Launches only: no device sync."""
    return _best(logits, temperatures, seed, 0, logits.shape[1], pairs=False)


def sample_gumbel_shard(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, col_start: int,
                        vocab: int) -> torch.Tensor:
    """One rank's part of `sample_gumbel` over a vocabulary split by columns: logits [R, C] hold
    columns [col_start, col_start + C) of rows of `vocab` columns (those past `vocab`: padding) ->
    float32 [2, R]: each row's best score (the tempered logit plus its noise; the logit where
    T = 0), then its global column (exact: vocab < 2**24). The best score over the shards, lowest
    column on ties, is the token `sample_gumbel` draws from the whole rows with the same seed."""
    if vocab >= 2**24:
        raise ValueError(f"vocab={vocab} is invalid: a column travels as a float32, exact below 2**24")
    return _best(logits, temperatures, seed, col_start, vocab, pairs=True)
