"""Paged decode attention in Gluon (Triton's lower-level language) with TMA page loads: the per-KV-head
kernel's decomposition (a program per sequence, KV head and split), but each program streams its
pages through a ring of shared-memory buffers that it refills itself, one TMA box per page and head,
instead of Triton's cp.async pipeline.  Measured on an H200 (docs/kernels.md): Gluon TMA reads stream 1 GiB at
4.58 TB/s where SDPA (cuDNN) reads at 4.44 and every cp.async loop we wrote at <= 4.42.

GPU only (Hopper or newer; Gluon has no CPU interpreter): `paged_decode_attention` selects it with a
`TmaDecodeConfig` where `tma_decode_supported` holds, and the GPU tests check it against the same
float64 reference as the other kernels.  Splits write partials that the per-head kernel's merge
kernel combines.

The query heads of the KV head are the MMA's N (8 or 16 columns), the step's tokens and head_dim
its M: S^T = K Q^T and O^T += V^T P^T take half the MMAs of a 16-row query tile when the
GQA group is 8 or less.  Per step a program first refills the buffer it read in the step before
with the pages `lead` steps ahead (page ids loaded a step earlier), then waits for this step's
buffer (one mbarrier for its K and V), reads it into operand registers and does the math: online
softmax in log2 units.  Only a split's last step can hold slots past the context: there they are
masked to -inf in S and to 0 in V (a stale slot may hold NaN).  With an `order` the grid's
sequence index goes through it (longest first past one wave, kernels/decode_splits.py).
"""

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.common import LOG2E

_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # renamed in triton 3.7


@dataclass(slots=True, frozen=True)
class TmaDecodeConfig:
    """The Gluon TMA kernel; defaults from its H200 sweeps at batch 64 x 4k (docs/kernels.md)."""

    tile_tokens: int = 32  # tokens per step (whole pages: a multiple of block_size)
    num_bufs: int = 2  # steps in the ring (deeper rings were slower)
    # Steps issued ahead of the one computed.  An int < num_bufs: the buffer read in the step before is
    # refilled ahead of this step's wait.  None (= num_bufs): a step's buffer is refilled once read into
    # registers, after its wait; ptxas then schedules the refill's TMAs among the step's math.
    lead: int | None = 1
    num_splits: int | None = None  # None: the per-head kernel's heuristic (kernels/decode_splits.py)
    programs_per_sm: int = 4  # for the split heuristic and the launch order
    min_split_tokens: int = 256  # the split heuristic never cuts a context finer than this
    num_warps: int = 1  # more split the step's tokens (S) and head_dim (O), paying cross-warp reductions

    def __post_init__(self):
        if self.tile_tokens < 16 or self.tile_tokens & (self.tile_tokens - 1):
            raise ValueError(f"tile_tokens={self.tile_tokens} is invalid: a power of two >= 16 (the MMA's M)")
        if self.num_bufs < 2:
            raise ValueError(f"num_bufs={self.num_bufs} is invalid: at least 2 (one computed, one loading)")
        if self.lead is not None and not 1 <= self.lead < self.num_bufs:
            raise ValueError(f"lead={self.lead} is invalid: None or 1..num_bufs-1 (num_bufs={self.num_bufs})")

    @property
    def steps_ahead(self) -> int:
        return self.num_bufs if self.lead is None else self.lead


@gluon.jit
def _tma_decode_kernel(
    q_ptr, k_desc, v_desc, block_tables_ptr, context_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, scale_log2,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, table_width,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr,
    NUM_BUFS: gl.constexpr, NUM_SPLITS: gl.constexpr, NUM_HEADS: gl.constexpr, WARPS: gl.constexpr,
    HND: gl.constexpr, LEAD: gl.constexpr, MATH: gl.constexpr = True, order_ptr=None,
    ORDERED: gl.constexpr = False,
):  # fmt: skip
    PAGES: gl.constexpr = TILE // BLOCK_SIZE
    EARLY: gl.constexpr = LEAD < NUM_BUFS
    gl.static_assert(PAGES == 1 or PAGES == 2 or PAGES == 4, "a step covers one, two or four pages")
    kv_head = gl.program_id(0)
    b = gl.program_id(1)
    if ORDERED:  # the caller's launch order of the sequences (e.g. longest first)
        b = gl.load(order_ptr + b)
    split = gl.program_id(2)
    NQ: gl.constexpr = 8 if GROUP <= 8 else 16  # the MMA's N: query heads, padded
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, WARPS], [0, 1])

    length = gl.load(context_lens_ptr + b)
    pages = gl.cdiv(length, BLOCK_SIZE)
    chunk = gl.cdiv(gl.cdiv(pages, NUM_SPLITS), PAGES) * PAGES  # whole steps per split
    first = split * chunk
    last = gl.minimum(pages, first + chunk)
    steps = gl.cdiv(gl.maximum(last - first, 0), PAGES)
    end = gl.minimum(length, last * BLOCK_SIZE)
    table = block_tables_ptr + b * stride_bt
    # NHD storage: a page's head is rows [id * BLOCK_SIZE, +BLOCK_SIZE) at column kv_head * HEAD_DIM of a
    # [blocks x block_size, kv_heads x head_dim] view; HND: rows [(id * kv_heads + kv_head) * BLOCK_SIZE, ...)
    # of a [blocks x kv_heads x block_size, head_dim] view (one contiguous chunk).
    column = 0 if HND else kv_head * HEAD_DIM
    head_row = kv_head * BLOCK_SIZE if HND else 0
    row_scale: gl.constexpr = BLOCK_SIZE * (NUM_HEADS // GROUP) if HND else BLOCK_SIZE

    k_ring = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUFS, TILE, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUFS, TILE, HEAD_DIM], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFS):
        mbarrier.init(bars.index(i), count=1)
    step_bytes: gl.constexpr = 2 * TILE * HEAD_DIM * 2  # K and V, 16-bit
    for i in gl.static_range(LEAD):
        ok = i < steps
        mbarrier.expect(bars.index(i), step_bytes, pred=ok)
        for g in gl.static_range(PAGES):
            page = first + i * PAGES + g
            if NUM_SPLITS == 1:  # masked by the table's width, not the length: both loads start at once
                pid = gl.load(table + (i * PAGES + g), mask=i * PAGES + g < table_width, other=0)
                pid = gl.where(page < last, pid, 0)
            else:
                pid = gl.load(table + page, mask=ok & (page < last), other=0)
            _load_page(k_desc, v_desc, pid * row_scale + head_row, column, bars.index(i), k_ring.index(i), v_ring.index(i), g, ok,
                       BLOCK_SIZE)  # fmt: skip

    cols = gl.arange(0, NQ, layout=gl.SliceLayout(0, io))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, io))
    col_ok = (cols < GROUP)[None, :]
    heads = kv_head * GROUP + cols
    q = gl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + dims[:, None], mask=col_ok, other=0.0)
    q = gl.convert_layout(q, b_op)  # Q^T: [HEAD_DIM, NQ]
    m_i = gl.full([NQ], -1.0e30, gl.float32, layout=gl.SliceLayout(0, mma))
    l_i = gl.zeros([NQ], gl.float32, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([HEAD_DIM, NQ], gl.float32, layout=mma)  # O^T
    s_rows = gl.arange(0, TILE, layout=gl.SliceLayout(1, mma))
    v_cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, a_op))

    # Page ids of the next refill, loaded a step before they are needed: a load in the same step
    # would put its latency between the buffer's release and its refill, every step.
    ids = _page_ids(table, first + LEAD * PAGES, last, LEAD < steps, PAGES)
    for j in range(steps):
        buf = j % NUM_BUFS
        if EARLY:  # refill the buffer read in the step before, ahead of this step's wait
            ids = _refill(j, ids, table, first, last, steps, row_scale, head_row, column, k_desc, v_desc, bars,
                          k_ring, v_ring, LEAD, NUM_BUFS, PAGES, BLOCK_SIZE, step_bytes)  # fmt: skip
        mbarrier.wait(bars.index(buf), (j // NUM_BUFS) & 1)
        if MATH:  # False only in bench_kernels_sweep.py's loads-only timing
            k = k_ring.index(buf).load(a_op)
            v = v_ring.index(buf).permute((1, 0)).load(a_op)
        if not EARLY:  # refill this step's buffer, now in operand registers
            ids = _refill(j, ids, table, first, last, steps, row_scale, head_row, column, k_desc, v_desc, bars,
                          k_ring, v_ring, LEAD, NUM_BUFS, PAGES, BLOCK_SIZE, step_bytes)  # fmt: skip
        if MATH:
            start = (first + j * PAGES) * BLOCK_SIZE
            s = mma_v2(k, q, gl.zeros([TILE, NQ], gl.float32, layout=mma))  # S^T
            if start + TILE > end:  # only a split's last step has slots past the context (stale: maybe NaN)
                s = gl.where(((start + s_rows) < end)[:, None], s, float("-inf"))
                v = gl.where(((start + v_cols) < end)[None, :], v, gl.zeros_like(v))
            m_new = gl.maximum(m_i, gl.max(s, 0) * scale_log2)
            p = gl.exp2(s * scale_log2 - m_new[None, :])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, 0)
            acc = mma_v2(v, gl.convert_layout(p.to(v.dtype), b_op), acc * alpha[None, :])
            m_i = m_new

    for i in gl.static_range(NUM_BUFS):
        mbarrier.invalidate(bars.index(i))
    safe_l = gl.where(l_i > 0.0, l_i, 1.0)
    result = gl.convert_layout(acc / safe_l[None, :], io)
    if NUM_SPLITS == 1:
        out = out_ptr + b * stride_ob + heads[None, :] * stride_oh + dims[:, None]
        gl.store(out, result.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        part = (b * NUM_HEADS + heads) * NUM_SPLITS + split
        gl.store(part_out_ptr + part[None, :] * HEAD_DIM + dims[:, None], result, mask=col_ok)
        lse = gl.convert_layout(gl.where(l_i > 0.0, m_i + gl.log2(safe_l), float("-inf")), gl.SliceLayout(0, io))
        gl.store(part_lse_ptr + part, lse, mask=cols < GROUP)


@gluon.jit
def _refill(j, ids, table, first, last, steps, row_scale, head_row, column, k_desc, v_desc, bars, k_ring, v_ring,
            LEAD: gl.constexpr, NUM_BUFS: gl.constexpr, PAGES: gl.constexpr, BLOCK_SIZE: gl.constexpr,
            STEP_BYTES: gl.constexpr):  # fmt: skip
    """Issue step j + LEAD's pages (ids: their page ids) into its ring buffer, last read by step
    j + LEAD - NUM_BUFS; return the page ids of step j + 1 + LEAD, loaded a step before they are needed
    (a load in the same step would put its latency between the buffer's release and its refill)."""
    _cta_barrier()  # every warp has read the buffer to be refilled ...
    fence_async_shared()  # ... and those reads are ordered before the TMA writes (async proxy)
    fill = (j + LEAD) % NUM_BUFS
    ok = j + LEAD < steps
    mbarrier.expect(bars.index(fill), STEP_BYTES, pred=ok)
    rows = (ids[0] * row_scale + head_row, ids[1] * row_scale + head_row, ids[2] * row_scale + head_row,
            ids[3] * row_scale + head_row)  # fmt: skip
    _load_step(k_desc, v_desc, rows, column, bars.index(fill), k_ring.index(fill), v_ring.index(fill), ok,
               BLOCK_SIZE, PAGES)  # fmt: skip
    return _page_ids(table, first + (j + 1 + LEAD) * PAGES, last, j + 1 + LEAD < steps, PAGES)


@gluon.jit
def _page_ids(table, page, last, ok, PAGES: gl.constexpr):
    """The page ids (up to four) of one step starting at `page`; 0 past the split or the table."""
    id0 = gl.load(table + page, mask=ok & (page < last), other=0)
    id1 = 0
    id2 = 0
    id3 = 0
    if PAGES >= 2:
        id1 = gl.load(table + page + 1, mask=ok & (page + 1 < last), other=0)
    if PAGES == 4:
        id2 = gl.load(table + page + 2, mask=ok & (page + 2 < last), other=0)
        id3 = gl.load(table + page + 3, mask=ok & (page + 3 < last), other=0)
    return id0, id1, id2, id3


@gluon.jit
def _load_step(k_desc, v_desc, rows, column, bar, k_buf, v_buf, ok, BLOCK_SIZE: gl.constexpr, PAGES: gl.constexpr):
    """TMA the PAGES pages of one step (their first rows in `rows`, a 4-tuple) into a step buffer."""
    _load_page(k_desc, v_desc, rows[0], column, bar, k_buf, v_buf, 0, ok, BLOCK_SIZE)
    if PAGES >= 2:
        _load_page(k_desc, v_desc, rows[1], column, bar, k_buf, v_buf, 1, ok, BLOCK_SIZE)
    if PAGES == 4:
        _load_page(k_desc, v_desc, rows[2], column, bar, k_buf, v_buf, 2, ok, BLOCK_SIZE)
        _load_page(k_desc, v_desc, rows[3], column, bar, k_buf, v_buf, 3, ok, BLOCK_SIZE)


@gluon.jit
def _load_page(k_desc, v_desc, row, column, bar, k_buf, v_buf, g: gl.constexpr, ok, BLOCK_SIZE: gl.constexpr):
    """TMA the K and V rows of one page's KV head (first row `row`) into slot g of a step buffer."""
    tma.async_copy_global_to_shared(k_desc, [row, column], bar, k_buf.slice(g * BLOCK_SIZE, BLOCK_SIZE), pred=ok)
    tma.async_copy_global_to_shared(v_desc, [row, column], bar, v_buf.slice(g * BLOCK_SIZE, BLOCK_SIZE), pred=ok)


def cache_storage(cache: torch.Tensor) -> str | None:
    """"nhd" (contiguous as indexed) or "hnd" (each block's KV heads outermost, kernels.inputs), else None."""
    _, bs, hkv, d = cache.shape
    if cache.stride() == (bs * hkv * d, hkv * d, d, 1):
        return "nhd"
    if cache.stride() == (hkv * bs * d, d, bs * d, 1):
        return "hnd"
    return None


def tma_decode_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, config: TmaDecodeConfig) -> bool:
    """The shapes the kernel is built for: a Hopper+ GPU, fp16/bf16, head_dim 64 or 128, GQA group
    <= 16, one, two or four whole pages per step, NHD or HND cache storage (TMA needs 16-byte strides)."""
    return (
        q.is_cuda
        and torch.cuda.get_device_capability(q.device)[0] >= 9
        and q.dtype in (torch.float16, torch.bfloat16)
        and k_cache.dtype == q.dtype
        and k_cache.shape[-1] in (64, 128)
        and q.shape[1] // k_cache.shape[2] <= 16
        and config.tile_tokens // k_cache.shape[1] in (1, 2, 4)
        and config.tile_tokens % k_cache.shape[1] == 0
        and cache_storage(k_cache) is not None
        and cache_storage(v_cache) == cache_storage(k_cache)
    )


def _descriptor(cache: torch.Tensor) -> TensorDescriptor:
    nb, bs, hkv, d = cache.shape
    if cache_storage(cache) == "hnd":
        flat = torch.as_strided(cache, (nb * hkv * bs, d), (d, 1))
    else:
        flat = cache.view(nb * bs, hkv * d)
    layout = gl.NVMMASharedLayout.get_default_for([bs, d], gl.float16)  # 128-byte swizzle: conflict-free ldmatrix
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [bs, d], layout)


def paged_decode_tma(q, k_cache, v_cache, block_tables, context_lens, scale, out, part_out, part_lse, splits,
                     config: TmaDecodeConfig, math: bool = True, order: torch.Tensor | None = None):  # fmt: skip
    """Launch on checked inputs (kernels.decode.paged_decode_attention validates them, allocates the
    split partials and merges them, as for the per-head kernel)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    _tma_decode_kernel[(num_kv_heads, batch, splits)](
        q, _descriptor(k_cache), _descriptor(v_cache), block_tables,
        context_lens, out, part_out, part_lse, scale * LOG2E, q.stride(0), q.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), block_tables.shape[1],
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE=config.tile_tokens,
        NUM_BUFS=config.num_bufs, NUM_SPLITS=splits, NUM_HEADS=num_heads, WARPS=config.num_warps,
        HND=cache_storage(k_cache) == "hnd", LEAD=config.steps_ahead, MATH=math, order_ptr=order,
        ORDERED=order is not None, num_warps=config.num_warps,
    )  # fmt: skip
