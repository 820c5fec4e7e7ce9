"""Round 14 of kernels/NOTES.md: Gluon TMA reads against SDPA, run as `python -m
experiments.bench_read_rate --tma | --tma-1g` (CUDA, Hopper or newer).

Each program keeps NBUF boxes of BR rows (256 bytes each: one head_dim-128 bf16 row) in flight over
its contiguous share of the same bytes SDPA reads at batch 64 x 4k (and 32k), one thread issuing the
copies; the data is never looked at.  Swizzle 128 splits each row in two 128-byte boxes, 0 keeps it
whole.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from experiments.bench_read_rate import D, L, _sdpa_then_flat
from experiments.bench_timing import graph_ms


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
        flat = _sdpa_then_flat(ctx, add_bytes).view(-1, D)
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
