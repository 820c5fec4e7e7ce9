"""Round 12 of kernels/NOTES.md: what read rate can a Triton loop reach at all?  `python -m
experiments.bench_read_rate [--out DIR]` (CUDA only).

Same bytes as decode at batch 64 x 4k (Qwen3-0.6B: 8 KV heads, head_dim 128, bf16): K and V as
512 items of 4096 x 128, item-major, i.e. exactly SDPA's [64, 8, 4096, 128] tensors.  A stream
kernel runs the decode loop's memory and tensor-core skeleton (QK^T and PV dots on a 16-row tile,
no softmax: round 11 showed it costs nothing) over them, with three things switchable that the
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
import datetime

import pandas as pd
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from experiments.bench_kernels_sweep import uniform
from experiments.bench_timing import copy_gbps, graph_ms
from kernels.decode import DecodeConfig

B, HQ, HKV, L, D, PAGE = 64, 16, 8, 4096, 128, 16


@triton.jit
def _stream_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, times_ptr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                   D: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr, PAGE: tl.constexpr, TIMES: tl.constexpr = False):  # fmt: skip
    item = tl.program_id(0)
    if TIMES:
        tl.store(times_ptr + item * 3, _globaltimer())
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, D)
    offs_h = tl.arange(0, 16)
    q = tl.load(q_ptr + item * 16 * D + offs_h[:, None] * D + offs_d[None, :])
    acc = tl.zeros([16, D], dtype=tl.float32)
    length = tl.load(lens_ptr + item)
    k_base = k_ptr + offs_d[None, :]
    v_base = v_ptr + offs_d[None, :]
    table = table_ptr + item * (ROWS // PAGE)
    page = tl.load(table + offs_r // PAGE).to(tl.int64)
    for r in range(0, ROWS, BLOCK_R):  # plain range: tl.range(num_stages=) gave K/V one buffer when paged
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
    tl.store(out_ptr + item * 16 * D + offs_h[:, None] * D + offs_d[None, :], acc)
    if TIMES:
        tl.store(times_ptr + item * 3 + 1, _globaltimer())
        tl.store(times_ptr + item * 3 + 2, _smid())


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
        flat = _sdpa_then_flat(ctx, add_bytes)
        _read_variants(flat, ctx, add_bytes)
        del flat
        torch.cuda.empty_cache()


def _sdpa_then_flat(ctx: int, add_bytes) -> torch.Tensor:
    k = torch.randn(B, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    ms = graph_ms([lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)])
    add_bytes(f"ceiling-{ctx}-sdpa", ms, k.nbytes + v.nbytes)
    return torch.cat([k.view(-1), v.view(-1)])


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


def timeline_round(add, out_dir: str, stamp: str) -> None:
    """Each program's start and end (%globaltimer) and SM in the last of a graph's calls: where the
    time beyond bytes / rate goes (start spread, ramp, the spread of end times)."""
    items = B * HKV
    k = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q16 = torch.randn(items, 16, D, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(items * (L // PAGE), device="cuda", dtype=torch.int32)
    lens = torch.full((items,), L, device="cuda", dtype=torch.int32)
    out = torch.empty(items, 16, D, device="cuda", dtype=torch.float32)
    times = torch.zeros(items, 3, device="cuda", dtype=torch.int64)
    frames = []
    for paged, n, st, w in ((1, 32, 3, 4), (1, 32, 4, 4), (0, 64, 2, 4)):

        def call(paged=paged, n=n, st=st, w=w):
            _stream_kernel[(items,)](q16, k, v, table, lens, out, times, ROWS=L, BLOCK_R=n, D=D, PAGED=paged,
                                     MASK=paged, PAGE=PAGE, TIMES=True, num_warps=w, num_stages=st)  # fmt: skip

        name = f"timeline-p{paged}m{paged}-n{n}s{st}w{w}"
        add(name, graph_ms([call]))
        t = pd.DataFrame(times.cpu().numpy(), columns=["start_ns", "end_ns", "sm"])
        t0 = t.start_ns.min()
        t["start_us"], t["end_us"] = (t.start_ns - t0) / 1e3, (t.end_ns - t0) / 1e3
        t["on_sm"] = t.groupby("sm").sm.transform("size")
        t["variant"] = name
        frames.append(t.drop(columns=["start_ns", "end_ns"]))
        ends = t.end_us.quantile([0.0, 0.1, 0.5, 0.9, 1.0]).round(1).tolist()
        by_sm = t.groupby("on_sm").end_us.mean().round(1).to_dict()
        print(f"    starts within {t.start_us.max():.1f} us; ends min/p10/p50/p90/max {ends} us; "
              f"mean end by programs on the SM {by_sm}", flush=True)  # fmt: skip
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
                    _stream_kernel[(items,)](q16, k, v, table, lens, out, out, ROWS=L, BLOCK_R=n, D=D, PAGED=paged,
                                             MASK=mask, PAGE=PAGE, num_warps=w, num_stages=s)  # fmt: skip

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
    parser.add_argument("--out", default="experiments/results")
    parser.add_argument(
        "--ceiling", action="store_true", help="plain read kernels at 1 and 8 GiB beside SDPA"
    )
    parser.add_argument(
        "--timeline", action="store_true", help="per-program start/end times of the stream kernel"
    )
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M")
    copy_bw = copy_gbps()
    print(
        f"{device} | torch {torch.__version__} | triton {triton.__version__} | {date} | copy {copy_bw:.0f} GB/s"
    )
    path = f"{args.out}/bench_read_rate_{device.replace(' ', '_')}_{date.replace(':', '')}.csv"
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
    if args.timeline:
        timeline_round(add, args.out, f"{device.replace(' ', '_')}_{date.replace(':', '')}")
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
