"""What read rate can a Triton loop reach at all, and where does a
decode launch's time go?  `python -m experiments.lab.bench_read_rate [--ceiling | --timeline | --tma |
--tma-1g | --tma-paged] [--out DIR]` (CUDA only).

`--ceiling`: plain read kernels (no math) over 1 GiB and 8 GiB with 2-16 programs per SM, beside SDPA
on as many bytes: the device's read ceiling.  `--timeline`: every work unit's start, end (%globaltimer)
and SM for the paged skeleton below, as whole items, chunks of items, or chunks taken from an atomic
queue by a fixed grid; writes the units to a second CSV.  `--tma` / `--tma-1g`: Gluon TMA reads
(experiments/lab/bench_read_tma.py); `--tma-paged`: TMA reads of the decode benchmark's paged
cache, by KV head and by whole pages, then `--tma-1g`.

Default: same bytes as decode at batch 64 x 4k (Qwen3-0.6B: 8 KV heads, head_dim 128, bf16): K and V as
512 items of 4096 x 128, item-major, i.e. exactly SDPA's [64, 8, 4096, 128] tensors.  A stream
kernel runs the decode loop's memory and tensor-core skeleton (QK^T and PV dots on a 16-row tile,
no softmax: it costs nothing measurable) over them, with three things switchable that the
production kernel has and SDPA's contiguous loop has not:
- PAGED: row addresses from page ids (block table, pages of 16 rows, sequential), loaded a tile ahead
- MASK: loads masked with `row < length` (the production kernel masks every tile)
- tile rows, pipeline depth, warps.
Beside them: SDPA on the same tensors, torch's sum over K and V (a plain read), and the production
per-head kernel on its usual random paged problem.  If the unpaged, unmasked stream reaches SDPA,
the gap is the paging/masking and can be engineered in Triton; if no variant does, Triton's
pipelined loads are the limit.
"""

import argparse

import pandas as pd
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from experiments.lab.decode_points import uniform
from experiments.lab.read_bytes import HKV, HQ, PAGE, B, D, L, sdpa_then_flat
from experiments.lib.kernel_timing import copy_gbps, graph_ms, run_stamp
from kernels.decode import DecodeConfig


@triton.jit
def _stream_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, times_ptr, queue_ptr, ROWS: tl.constexpr,
                   BLOCK_R: tl.constexpr, D: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr,
                   PAGE: tl.constexpr, TIMES: tl.constexpr = False, CHUNKS: tl.constexpr = 1,
                   NUM_ITEMS: tl.constexpr = 1, QUEUE: tl.constexpr = False):  # fmt: skip
    """One work unit (item, chunk of its rows) per program, or (QUEUE) a fixed grid of programs taking
    units from an atomic counter until none is left; the last program to leave resets the counters."""
    if QUEUE:
        work = tl.atomic_add(queue_ptr, 1)
        while work < NUM_ITEMS * CHUNKS:
            _stream_unit(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, times_ptr, work, ROWS, BLOCK_R, D, PAGED,
                         MASK, PAGE, TIMES, CHUNKS, NUM_ITEMS)  # fmt: skip
            work = tl.atomic_add(queue_ptr, 1)
        left = tl.atomic_add(queue_ptr + 1, 1)
        if left == tl.num_programs(0) - 1:
            tl.store(queue_ptr, 0)
            tl.store(queue_ptr + 1, 0)
    else:
        _stream_unit(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, times_ptr, tl.program_id(0), ROWS, BLOCK_R, D,
                     PAGED, MASK, PAGE, TIMES, CHUNKS, NUM_ITEMS)  # fmt: skip


@triton.jit
def _stream_unit(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, times_ptr, work, ROWS: tl.constexpr,
                 BLOCK_R: tl.constexpr, D: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr,
                 PAGE: tl.constexpr, TIMES: tl.constexpr, CHUNKS: tl.constexpr, NUM_ITEMS: tl.constexpr):  # fmt: skip
    if TIMES:
        tl.store(times_ptr + work * 3, _globaltimer())
    item = work % NUM_ITEMS
    first = (work // NUM_ITEMS) * (ROWS // CHUNKS)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, D)
    offs_h = tl.arange(0, 16)
    q = tl.load(q_ptr + item * 16 * D + offs_h[:, None] * D + offs_d[None, :])
    acc = tl.zeros([16, D], dtype=tl.float32)
    length = tl.load(lens_ptr + item)
    k_base = k_ptr + offs_d[None, :]
    v_base = v_ptr + offs_d[None, :]
    table = table_ptr + item * (ROWS // PAGE)
    page = tl.load(table + (first + offs_r) // PAGE).to(tl.int64)
    for r in range(first, first + ROWS // CHUNKS, BLOCK_R):  # plain range: tl.range(num_stages=) gave K/V one buffer
        rows = r + offs_r
        if PAGED:
            addr = (page * PAGE + rows % PAGE)[:, None] * D
        else:
            addr = (item.to(tl.int64) * ROWS + rows)[:, None] * D
        if MASK:
            keep = (rows < length)[:, None]
            k = tl.load(k_base + addr, mask=keep, other=0.0)
            v = tl.load(v_base + addr, mask=keep, other=0.0)
        else:
            k = tl.load(k_base + addr)
            v = tl.load(v_base + addr)
        if PAGED:  # after the K/V loads, as in the production kernel
            after = rows + BLOCK_R
            page = tl.load(table + after // PAGE, mask=after < ROWS, other=0).to(tl.int64)
        s = tl.dot(q, tl.trans(k))
        acc = tl.dot(s.to(v.dtype), v, acc)
    tl.store(out_ptr + work * 16 * D + offs_h[:, None] * D + offs_d[None, :], acc)
    if TIMES:
        tl.store(times_ptr + work * 3 + 1, _globaltimer())
        tl.store(times_ptr + work * 3 + 2, _smid())


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _smid():
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    ).to(tl.int64)


@triton.jit
def _read_kernel(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    """A plain read: each program sums its contiguous share elementwise (no reduction in the loop)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = x_ptr + pid.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(base + i + offs).to(tl.float32)
    tl.store(out_ptr + pid * BLOCK + offs, acc)


def ceiling_round(add_bytes) -> None:
    """The device's read ceiling: plain read kernels (ld.global at stages 1, cp.async above) over
    1 GiB and 8 GiB with 2-16 programs per SM, beside SDPA on as many bytes (B64 x 4k and x 32k)."""
    for ctx in (L, 8 * L):
        flat = sdpa_then_flat(ctx, add_bytes)
        _read_variants(flat, ctx, add_bytes)
        del flat
        torch.cuda.empty_cache()


def _read_variants(flat: torch.Tensor, ctx: int, add_bytes) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for per_sm in (2, 4, 8, 16):
        for block, warps, stages in ((2048, 4, 1), (4096, 8, 1), (8192, 8, 1), (2048, 4, 3), (4096, 4, 3)):
            programs = sms * per_sm
            per_program = flat.numel() // programs // block * block
            out = torch.empty(programs * block, device="cuda", dtype=torch.float32)

            def call(
                programs=programs, per_program=per_program, out=out, block=block, warps=warps, stages=stages
            ):
                _read_kernel[(programs,)](
                    flat, out, per_program, BLOCK=block, num_warps=warps, num_stages=stages
                )

            name = f"ceiling-{ctx}-read-pp{per_sm}-b{block}w{warps}s{stages}"
            add_bytes(name, graph_ms([call]), programs * per_program * 2)


TIMELINES = [  # (stages, chunks per item, programs per SM of an atomic-queue grid or 0: one program per unit)
    (3, 1, 0), (4, 1, 0), (4, 2, 0), (4, 4, 0), (3, 4, 0), (4, 2, 4), (4, 4, 4), (4, 8, 4), (3, 4, 5), (3, 8, 5),
]  # fmt: skip


def timeline_round(add, out_dir: str, stamp: str) -> None:
    """Each work unit's start and end (%globaltimer) and SM in the last of a graph's calls (paged,
    masked n32 skeleton at B64x4k): where the time beyond bytes / rate goes.  Units are whole items
    or chunks of them, one program each or taken from an atomic queue by a fixed grid; SDPA beside."""
    items = B * HKV
    k = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    add("sdpa", graph_ms([lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)]))
    q16 = torch.randn(items, 16, D, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(items * (L // PAGE), device="cuda", dtype=torch.int32)
    lens = torch.full((items,), L, device="cuda", dtype=torch.int32)
    out = torch.empty(items * 8, 16, D, device="cuda", dtype=torch.float32)
    queue = torch.zeros(2, device="cuda", dtype=torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    frames = []
    for stages, chunks, per_sm in TIMELINES:
        times = torch.zeros(items * chunks, 3, device="cuda", dtype=torch.int64)
        grid = sms * per_sm if per_sm else items * chunks

        def call(stages=stages, chunks=chunks, per_sm=per_sm, grid=grid, times=times):
            _stream_kernel[(grid,)](q16, k, v, table, lens, out, times, queue, ROWS=L, BLOCK_R=32, D=D, PAGED=1,
                                    MASK=1, PAGE=PAGE, TIMES=True, CHUNKS=chunks, NUM_ITEMS=items, QUEUE=per_sm > 0,
                                    num_warps=4, num_stages=stages)  # fmt: skip

        name = f"timeline-s{stages}-chunks{chunks}-" + (f"queue{per_sm}" if per_sm else "grid")
        add(name, graph_ms([call]))
        t = pd.DataFrame(times.cpu().numpy(), columns=["start_ns", "end_ns", "sm"])
        t0 = t.start_ns.min()
        t["start_us"], t["end_us"] = (t.start_ns - t0) / 1e3, (t.end_ns - t0) / 1e3
        t["variant"] = name
        frames.append(t.drop(columns=["start_ns", "end_ns"]))
        last = t.groupby("sm").end_us.max()
        busy = (t.end_us - t.start_us).sum() / (last.max() * sms)
        units = t.groupby("sm").size()
        print(f"    span {last.max():.1f} us; SMs' last end min/p10/p50/max {last.quantile([0, .1, .5, 1]).round(1).tolist()}; "
              f"units per SM {units.min()}..{units.max()}; unit-time / (span x SMs) {busy:.2f}", flush=True)  # fmt: skip
    pd.concat(frames).to_csv(f"{out_dir}/bench_read_rate_timeline_{stamp}.csv", index=False)


VARIANTS = [(n, s, w) for n, s, w in ((32, 3, 4), (32, 4, 4), (64, 2, 4), (64, 3, 4), (64, 3, 8), (128, 2, 8),
                                      (128, 3, 8), (16, 4, 2), (32, 3, 2), (64, 2, 2), (32, 2, 4), (128, 2, 4))]  # fmt: skip


def stream_round(add) -> None:
    """SDPA, torch's sum and the stream kernel's variants on one set of K/V tensors."""
    items = B * HKV
    k = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
    q16 = torch.zeros(items, 16, D, device="cuda", dtype=torch.bfloat16)
    q16[:, :2] = q.view(items, 2, D)
    table = torch.arange(items * (L // PAGE), device="cuda", dtype=torch.int32)
    lens = torch.full((items,), L, device="cuda", dtype=torch.int32)
    out = torch.empty(items, 16, D, device="cuda", dtype=torch.float32)

    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    add("sdpa", graph_ms([sdpa]))
    add("torch-sum-k+v", graph_ms([lambda: (k.sum(dtype=torch.float32), v.sum(dtype=torch.float32))]))
    ref = (q16.float() @ k.view(items, L, D).float().transpose(1, 2)).bfloat16().float() @ v.view(
        items, L, D
    ).float()
    for paged in (0, 1):
        for mask in (0, 1):
            for n, s, w in VARIANTS:
                if (paged or mask) and (n, s, w) not in ((32, 3, 4), (32, 4, 4), (64, 3, 8), (128, 2, 8)):
                    continue
                name = f"stream-p{paged}m{mask}-n{n}s{s}w{w}"

                def call(n=n, s=s, w=w, paged=paged, mask=mask):
                    _stream_kernel[(items,)](q16, k, v, table, lens, out, out, out, ROWS=L, BLOCK_R=n, D=D, PAGED=paged,
                                             MASK=mask, PAGE=PAGE, NUM_ITEMS=items, num_warps=w, num_stages=s)  # fmt: skip

                try:
                    call()
                    err = ((out - ref).norm() / ref.norm()).item()
                    if err > 2e-2:
                        print(f"  {name} WRONG rel err {err:.3g}", flush=True)
                    add(name, graph_ms([call]))
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    add("sdpa-again", graph_ms([sdpa]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_read_rate")
    parser.add_argument(
        "--ceiling", action="store_true", help="plain read kernels at 1 and 8 GiB beside SDPA"
    )
    parser.add_argument(
        "--timeline", action="store_true", help="per-program start/end times of the stream kernel"
    )
    parser.add_argument("--tma", action="store_true", help="Gluon TMA read kernels at 1 and 8 GiB beside SDPA")
    parser.add_argument("--tma-1g", action="store_true", help="--tma at 1 GiB only, 128-byte swizzle only")
    parser.add_argument("--tma-paged", action="store_true", help="TMA reads of the paged cache, then --tma-1g")
    args = parser.parse_args()
    stamp = run_stamp()
    device, date = stamp.device, stamp.date
    copy_bw = copy_gbps()
    print(f"copy {copy_bw:.0f} GB/s (read+write)")
    path = stamp.csv(args.out, "bench_read_rate")
    rows: list[dict] = []
    nbytes = 2 * B * HKV * L * D * 2

    def add(variant: str, ms: float, nbytes: int = nbytes) -> None:
        row = {"device": device, "date": date, "variant": variant, "time_us": ms * 1e3,
               "GBps": nbytes / ms / 1e6, "frac_copy": nbytes / ms / 1e6 / copy_bw}  # fmt: skip
        rows.append(row)
        print(f"  {variant:<40}{row['time_us']:>9.1f} us {row['GBps']:>7.0f} GB/s {row['frac_copy']:.3f} of copy",
              flush=True)  # fmt: skip
        pd.DataFrame(rows).to_csv(path, index=False)

    if args.ceiling:
        ceiling_round(add)
        return
    if args.tma or args.tma_1g or args.tma_paged:
        from experiments.lab.bench_read_tma import paged_round, tma_round  # Gluon: its own module

        paged_round(add) if args.tma_paged else tma_round(add, small_only=args.tma_1g)
        return
    if args.timeline:
        timeline_round(add, args.out, stamp.tag)
        return
    stream_round(add)
    torch.cuda.empty_cache()
    for r in uniform(
        B,
        L,
        copy_bw,
        [
            DecodeConfig(num_splits=1),
            DecodeConfig(num_stages=3, num_splits=1),
            DecodeConfig(num_stages=3, num_warps=2, num_splits=1),
            DecodeConfig(block_n=64, num_stages=2, num_splits=1),
        ],
    ):
        add(f"production-{r['variant']}", r["time_us"] / 1e3)


if __name__ == "__main__":
    main()
