"""Gluon TMA reads against SDPA, run as `python -m
experiments.lab.bench_read_rate --tma | --tma-1g | --tma-paged` (CUDA, Hopper or newer).

Each program keeps NBUF boxes of BR rows (256 bytes each: one head_dim-128 bf16 row) in flight over
its contiguous share of the same bytes SDPA reads at batch 64 x 4k (and 32k), one thread issuing the
copies; the data is never looked at.  Swizzle 128 splits each row in two 128-byte boxes, 0 keeps it
whole.  `--tma-paged` reads the decode benchmark's paged cache through its block table instead.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from experiments.lab.read_bytes import D, L, sdpa_then_flat
from experiments.lib.kernel_timing import graph_ms


@gluon.jit
def _tma_read_kernel(desc, rows_per_program, BR: gl.constexpr, NBUF: gl.constexpr):
    """A TMA read: one thread keeps NBUF boxes of BR rows in flight over the program's rows; the
    data is never looked at (a box's buffer is reused once its mbarrier says it arrived)."""
    smem = gl.allocate_shared_memory(desc.dtype, [NBUF, BR, 128], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(bars.index(i), count=1)
    base = gl.program_id(0) * rows_per_program
    tiles = rows_per_program // BR
    for i in gl.static_range(NBUF):
        mbarrier.expect(bars.index(i), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [base + i * BR, 0], bars.index(i), smem.index(i))
    for i in range(NBUF, tiles):
        slot = i % NBUF
        mbarrier.wait(bars.index(slot), (i // NBUF - 1) & 1)
        mbarrier.expect(bars.index(slot), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [base + i * BR, 0], bars.index(slot), smem.index(slot))
    for i in range(tiles, tiles + NBUF):
        mbarrier.wait(bars.index(i % NBUF), (i // NBUF - 1) & 1)
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(bars.index(i))


TMA_VARIANTS = [(64, 8, 1), (128, 6, 1), (256, 3, 1), (64, 6, 2), (128, 3, 2), (32, 8, 4), (64, 3, 4), (32, 4, 6),
                (16, 16, 1), (16, 8, 2), (16, 4, 4), (16, 8, 4), (16, 2, 4), (32, 4, 4), (32, 2, 4)]  # fmt: skip


def tma_round(add_bytes, small_only: bool = False) -> None:
    """Gluon TMA reads (rows of 256 B, boxes of BR rows, NBUF in flight per program, 1-6 programs
    per SM; 128 B swizzle or none) over 1 GiB and 8 GiB, beside SDPA on as many bytes."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for ctx in (L,) if small_only else (L, 8 * L):
        flat = sdpa_then_flat(ctx, add_bytes).view(-1, D)
        for br, nbuf, per_sm in TMA_VARIANTS:
            for swizzle in (128,) if small_only else (128, 0):
                programs = sms * per_sm
                rows = flat.shape[0] // programs // br * br
                layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)
                desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [br, D], layout)

                def call(programs=programs, rows=rows, desc=desc, br=br, nbuf=nbuf):
                    _tma_read_kernel[(programs,)](desc, rows, BR=br, NBUF=nbuf, num_warps=1)

                name = f"tma-{ctx}-br{br}-nbuf{nbuf}-pp{per_sm}-sw{swizzle}"
                try:
                    add_bytes(name, graph_ms([call]), programs * rows * D * 2)
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        del flat
        torch.cuda.empty_cache()


@gluon.jit
def _tma_paged_read_kernel(k_desc, v_desc, tables, stride_bt, heads, splits, pages_per_program, PER_HEAD: gl.constexpr,
                           ROWS: gl.constexpr, BR: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
    """A TMA read of a paged K/V cache through its block table, nothing computed.  PER_HEAD:
    a program per (sequence, KV head) reads that head's 16 rows of every page (the decode kernel's
    boxes); else a program per (sequence, split) reads whole pages (ROWS rows of 256 B: every head),
    BR rows per box.  One thread keeps NBUF boxes in flight; a unit's page id is loaded one unit early."""
    PARTS: gl.constexpr = ROWS // BR
    pid = gl.program_id(0)
    if PER_HEAD:
        b = pid // heads
        col = (pid % heads) * 128
        first = 0
    else:
        b = pid // splits
        col = 0
        first = (pid % splits) * pages_per_program
    table = tables + b * stride_bt + first
    units = pages_per_program * 2 * PARTS  # K and V
    smem = gl.allocate_shared_memory(k_desc.dtype, [NBUF, BR, 128], k_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(NBUF):
        _issue_unit(k_desc, v_desc, i, gl.load(table + i // (2 * PARTS)), col, bars.index(i), smem.index(i), ROWS, BR)
    nid = gl.load(table + NBUF // (2 * PARTS))
    for u in range(NBUF, units):
        cur = nid
        nid = gl.load(table + (u + 1) // (2 * PARTS), mask=u + 1 < units, other=0)
        slot = u % NBUF
        mbarrier.wait(bars.index(slot), (u // NBUF - 1) & 1)
        _issue_unit(k_desc, v_desc, u, cur, col, bars.index(slot), smem.index(slot), ROWS, BR)
    for u in range(units, units + NBUF):
        mbarrier.wait(bars.index(u % NBUF), (u // NBUF - 1) & 1)
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _issue_unit(k_desc, v_desc, u, page_id, col, bar, buf, ROWS: gl.constexpr, BR: gl.constexpr):
    PARTS: gl.constexpr = ROWS // BR
    is_v = (u // PARTS) % 2 == 1
    row = page_id * ROWS + (u % PARTS) * BR
    mbarrier.expect(bar, k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], bar, buf, pred=not is_v)
    tma.async_copy_global_to_shared(v_desc, [row, col], bar, buf, pred=is_v)


PAGED_VARIANTS = [(True, 16, 4, 128), (True, 16, 8, 128), (True, 16, 4, 0), (True, 16, 8, 0), (False, 64, 2, 0),
                  (False, 64, 3, 0), (False, 32, 4, 0), (False, 32, 6, 0), (False, 128, 2, 0)]  # fmt: skip


def paged_round(add_bytes) -> None:
    """`--tma-paged`: `_paged_reads`, then the contiguous probe at 1 GiB."""
    _paged_reads(add_bytes)
    torch.cuda.empty_cache()
    tma_round(add_bytes, small_only=True)


def _paged_reads(add_bytes) -> None:
    """TMA reads of the decode benchmark's paged cache at batch 64 x 4k (random block tables,
    block-major storage) by KV head (4 KB boxes, the decode kernel's) or by whole pages (32 KB per page
    and tensor, 8 splits per sequence: 512 programs either way), beside SDPA on the same bytes laid out
    contiguously and the decode kernel with and without its math."""
    from experiments.lib.kernel_cases import decode_problem
    from kernels.decode_tma import TmaDecodeConfig, paged_decode_tma

    prob, k, v = decode_problem(64, L, 16, 8, D, 16)
    nbytes = k.nbytes + v.nbytes
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(prob.q.unsqueeze(2), k, v, enable_gqa=True)
    add_bytes("paged-sdpa", graph_ms([sdpa]), nbytes)
    out = torch.empty_like(prob.q)
    for math in (True, False):
        call = lambda m=math: paged_decode_tma(*prob.decode_args(), out, out, out, 1, TmaDecodeConfig(num_splits=1), math=m)
        add_bytes(f"paged-decode-tma{'' if math else '-loadsonly'}", graph_ms([call]), nbytes)
    nb, bs, hkv, d = prob.k_cache.shape
    pages, programs, splits = L // bs, 64 * hkv, 8
    for per_head, br, nbuf, swizzle in PAGED_VARIANTS:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)
        shape = [nb * bs, hkv * d] if per_head else [nb * bs * hkv, d]
        descs = [TensorDescriptor(c.view(shape), shape, [shape[1], 1], [br, 128], layout) for c in (prob.k_cache, prob.v_cache)]

        def call(descs=descs, per_head=per_head, br=br, nbuf=nbuf):
            _tma_paged_read_kernel[(programs,)](
                *descs, prob.block_tables, prob.block_tables.stride(0), hkv, splits,
                pages if per_head else pages // splits, PER_HEAD=per_head, ROWS=bs if per_head else bs * hkv,
                BR=br, NBUF=nbuf, num_warps=1)  # fmt: skip

        name = f"paged-{'head' if per_head else 'page'}-br{br}-nbuf{nbuf}-sw{swizzle}"
        try:
            add_bytes(name, graph_ms([call]), nbytes)
        except Exception as exc:  # noqa: BLE001
            print(f"  {name} ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    add_bytes("paged-sdpa-end", graph_ms([sdpa]), nbytes)
