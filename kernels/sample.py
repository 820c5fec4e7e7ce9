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
def _consider(row_ptr, cols, vocab, u, inv_t, noisy, best_val, best_idx):
    """Fold columns `cols` (with uniforms `u`) into the running per-lane best (score, index)."""
    mask = cols < vocab
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-30)))
    x = tl.where(noisy, x * inv_t + gumbel, x)
    better = (x > best_val) & mask
    return tl.where(better, x, best_val), tl.where(better, cols, best_idx)


# A fresh seed every step, and temperatures in a step-input buffer whose offset is 8-byte aligned
# only (engine/device/batch_layout.py): neither is specialized on, so one compiled kernel serves
# every step, the one the runner compiles at start-up.
@triton.jit(do_not_specialize=["seed", "temps_ptr"])
def _chunk_best_kernel(
    logits_ptr,
    stride_r,
    temps_ptr,
    best_val_ptr,
    best_idx_ptr,
    seed,
    vocab,
    num_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Philox yields four uniforms per call: one call serves four BLOCK/4-column quarters of a tile
    (one uniform per call made sampling Philox-bound, 4x the integer work). Counters are unique per
    (row, tile, lane): row * (num_chunks * CHUNK / 4) + tile start / 4 + lane."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temps_ptr + row).to(tl.float32)
    noisy = temp > 0.0
    inv_t = 1.0 / tl.where(noisy, temp, 1.0)  # no 1 / 0 evaluated for greedy rows
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    best_val = tl.full([QUARTER], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([QUARTER], 2147483647, dtype=tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_r
    counter_base = row * (num_chunks * (CHUNK // 4))  # < 2**31: rows * padded vocab / 4 (checked)
    start = chunk * CHUNK
    for off in range(start, start + CHUNK, BLOCK):
        u0, u1, u2, u3 = tl.rand4x(seed, counter_base + off // 4 + lanes)
        cols = off + lanes
        best_val, best_idx = _consider(row_ptr, cols, vocab, u0, inv_t, noisy, best_val, best_idx)
        best_val, best_idx = _consider(row_ptr, cols + QUARTER, vocab, u1, inv_t, noisy, best_val, best_idx)
        best_val, best_idx = _consider(row_ptr, cols + 2 * QUARTER, vocab, u2, inv_t, noisy, best_val, best_idx)
        best_val, best_idx = _consider(row_ptr, cols + 3 * QUARTER, vocab, u3, inv_t, noisy, best_val, best_idx)
    top = tl.max(best_val, 0)
    idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), 0)
    tl.store(best_val_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, idx)


@triton.jit
def _row_best_kernel(best_val_ptr, best_idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    vals = tl.load(best_val_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    idxs = tl.load(best_idx_ptr + row * num_chunks + offs, mask=mask, other=2147483647)
    top = tl.max(vals, 0)
    idx = tl.min(tl.where(vals == top, idxs, 2147483647), 0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def sample_gumbel(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """logits [R, V] (float, last dim contiguous), temperatures [R] (0 = greedy), seed (int, the
    Philox stream) -> sampled token ids [R] int64. Launches only: no device sync."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)} is invalid: expected [rows, vocab] with a contiguous vocab dim")
    if temperatures.shape != (logits.shape[0],):
        raise ValueError(f"temperatures.shape={tuple(temperatures.shape)} is invalid: expected ({logits.shape[0]},)")
    rows, vocab = logits.shape
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits.dtype={logits.dtype} is invalid: float32, bfloat16 or float16")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunk = max(4, min(CHUNK, triton.next_power_of_2(vocab)))
    block = min(BLOCK, chunk)
    num_chunks = triton.cdiv(vocab, chunk)
    if rows * num_chunks * chunk >= 2**31:  # Philox counters and row offsets are int32
        raise ValueError(f"logits {tuple(logits.shape)} is invalid: rows x vocab (padded to {num_chunks * chunk}) "
                         "must be < 2**31")
    best_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_best_kernel[(rows, num_chunks)](
        logits, logits.stride(0), temperatures, best_val, best_idx, seed & 0x7FFFFFFF, vocab, num_chunks,
        CHUNK=chunk, BLOCK=block, num_warps=4,
    )  # fmt: skip
    _row_best_kernel[(rows,)](best_val, best_idx, out, num_chunks, BLOCK_C=triton.next_power_of_2(num_chunks))
    return out
