"""Merging split-KV partials of the per-KV-head decode kernel (kernels/decode.py).

With several splits per sequence every program writes its query heads' normalised partial output
and log-sum-exp.  Two ways to merge them:
- fused (the default): each program counts its arrival on a per-(sequence, KV head) counter after
  storing its partials; the last of the splits to arrive merges them and resets the counter, so
  the counters are all zero again when the launch ends (CUDA-graph replays need no memset).
- a second kernel over (sequence, query head), launched after the first.
Round 13 of kernels/NOTES.md: splits with the fused merge let the hardware hand later programs to
SMs that finished early (GPCs stream at different rates), which a single wave cannot.

The counters live in one zeroed int32 buffer per device, grown only outside CUDA-graph capture
(the engine warms every shape up eagerly before capturing it).  Launches that share the buffer
must be ordered on one stream, as the engine's are.
"""

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}
MIN_COUNTERS = 4096


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """A zeroed int32 buffer with at least `count` counters for `device` (kept zero by the kernels)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"decode needs {count} split-merge counters but {0 if buf is None else buf.numel()} exist: "
                "run one call of this batch size eagerly before capturing it in a CUDA graph"
            )
        buf = torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@triton.jit
def merge_if_last(
    part_out_ptr, part_lse_ptr, count_ptr, out_ptr, first_row, stride_oh, offs_h, offs_d, hd_mask,
    GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """After a program stored its partials (rows first_row + head, NUM_SPLITS per head): count its
    arrival; the last split of the (sequence, KV head) merges all of them into out and resets the
    counter.  The barrier puts every thread's partial stores before the release of the arrival;
    partials are read past L1 (.cg) because an earlier launch may have left stale lines there."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_SPLITS - 1:
        rows = (first_row + offs_h) * NUM_SPLITS
        h_mask = offs_h < GROUP
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for s in range(NUM_SPLITS):
            lse = tl.load(part_lse_ptr + rows + s, mask=h_mask, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(
                part_out_ptr + (rows + s)[:, None] * BLOCK_D + offs_d[None, :], mask=hd_mask, other=0.0,
                cache_modifier=".cg",
            )  # fmt: skip
            m_new = tl.maximum(m, lse)
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split saw a token yet: weights 0
            alpha = tl.exp2(m - base)
            weight = tl.exp2(lse - base)
            acc = acc * alpha[:, None] + part * weight[:, None]
            total = total * alpha + weight
            m = m_new
        merged = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        tl.store(out_ptr + offs_h[:, None] * stride_oh + offs_d[None, :], merged.to(out_ptr.dtype.element_ty),
                 mask=hd_mask)  # fmt: skip
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    rows = (b * NUM_HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + rows, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    parts = tl.load(part_out_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, 0)
    merged = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
