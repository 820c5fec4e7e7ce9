"""Benchmark of the paged-attention kernels on a CUDA GPU: `python -m experiments.bench_kernels`.

Measures the device's ceilings first (device-to-device copy bandwidth, bf16 matmul rate on random
data), then: decode over a batch x context grid (Qwen3-0.6B attention: 16 q heads, 8 KV heads,
head_dim 128, block_size 16, bf16) against SDPA on the same KV laid out contiguously and against
the plain-torch paged reference; prefill of single prompts (causal) against SDPA; KV write, block
copy and swap.  A variant sweep of tile shapes runs at the target points (decode 64 x 4k, prefill
8k), each variant checked against SDPA before it is timed.  Prints one table and writes it as CSV
(with device and date) to --out (default experiments/results/).
"""

import argparse
import datetime
import time

import pandas as pd
import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from experiments.bench_kernels_cases import (
    block_ops_rows,
    ceilings,
    decode_problem,
    kernel_report,
    prefill_problem,
)
from kernels import reference
from kernels.decode import DecodeConfig, paged_decode_attention
from kernels.prefill import PrefillConfig, paged_prefill_attention

HQ, HKV, D, BS = 16, 8, 128, 16
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (512, 4096, 32768)
PREFILL_TOKENS = (512, 1024, 2048, 4096, 8192)
REFERENCE_MAX_TOKENS = 64 * 4096  # the per-sequence torch reference is slow and memory-hungry
DECODE_SWEEP = [
    DecodeConfig(block_n=n, num_warps=w, num_stages=st, num_splits=sp)
    for n, w, st in [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (128, 4, 2)]
    for sp in (None, 1, 2, 4)
] + [
    DecodeConfig(block_n=n, num_stages=st, num_splits=sp, heads_fastest=False)
    for n, st, sp in [(64, 3, None), (64, 3, 1), (128, 3, None), (64, 4, 2)]
]
PREFILL_SWEEP = [
    PrefillConfig(block_m=m, block_n=n, num_warps=w, num_stages=s)
    for m, n, w, s in [
        (128, 64, 8, 3),
        (128, 64, 8, 2),
        (128, 64, 8, 4),
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (64, 64, 4, 3),
        (128, 32, 8, 4),
    ]
]


def _ms(fn, rep: int = 100) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _sdpa(q4, k, v, scale, causal, repeat_ok):
    """SDPA on contiguous [B, H, L, D]: enable_gqa, and K/V repeated to all q heads when that fits
    (in case GQA takes a slower backend); the faster is the baseline.  -> (fn, ms, how)."""
    gqa = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, is_causal=causal, enable_gqa=True)
    best = (gqa, _ms(gqa), "enable_gqa")
    if repeat_ok:
        group = q4.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        rep = lambda: F.scaled_dot_product_attention(q4, kr, vr, scale=scale, is_causal=causal)
        ms = _ms(rep)
        if ms < best[1]:
            best = (rep, ms, "repeat_kv")
    return best


def _row(kernel, shape, variant, ms, metric, unit, ceiling, sdpa_ms=None, ref_ms=None, err=None, note=""):
    """One table row; vs_sdpa / vs_reference are speed-ups (their time over ours)."""
    return {
        "kernel": kernel,
        "shape": shape,
        "variant": variant,
        "time_us": ms * 1e3,
        "achieved": metric,
        "unit": unit,
        "frac_of_ceiling": metric / ceiling,
        "vs_sdpa": (sdpa_ms / ms) if sdpa_ms else None,
        "vs_reference": (ref_ms / ms) if ref_ms else None,
        "rel_err_vs_sdpa": err,
        "note": note,
    }


def _variant_name(cfg: DecodeConfig | PrefillConfig) -> str:
    if cfg in (DecodeConfig(), PrefillConfig()):
        return "default"
    if isinstance(cfg, DecodeConfig):
        order = "" if cfg.heads_fastest else "-bfirst"
        return f"n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}sp{cfg.num_splits or 'auto'}{order}"
    return f"m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"


def _time_variant(
    kernel: str, shape: str, cfg, fn, expected: torch.Tensor | None
) -> tuple[float, float | None] | dict:
    """(ms, rel err vs SDPA) of one variant, or an error row: a variant that fails is reported, not fatal."""
    try:
        out = fn(cfg)
        err = _rel_err(out, expected) if expected is not None else None
        return _ms(lambda: fn(cfg)), err
    except Exception as exc:  # noqa: BLE001
        return {
            "kernel": kernel,
            "shape": shape,
            "variant": _variant_name(cfg),
            "note": f"error: {type(exc).__name__}: {str(exc)[:200]}",
        }


def _decode_point(batch: int, ctx: int, copy_bw: float, configs: list[DecodeConfig]) -> list[dict]:
    prob, k_contig, v_contig = decode_problem(batch, ctx, HQ, HKV, D, BS)
    shape = f"B{batch}xL{ctx}"
    nbytes = 2 * batch * ctx * HKV * D * 2 + 2 * batch * HQ * D * 2
    small = batch * ctx <= REFERENCE_MAX_TOKENS
    sdpa_fn, sdpa_ms, how = _sdpa(prob.q.unsqueeze(2), k_contig, v_contig, prob.scale, False, small)
    expected = sdpa_fn().squeeze(2)
    ref_ms = _ms(lambda: reference.paged_decode_attention(*prob.decode_args()), rep=50) if small else None
    rows = [_row("sdpa_decode", shape, how, sdpa_ms, nbytes / sdpa_ms / 1e6, "GB/s", copy_bw)]
    for cfg in configs:
        res = _time_variant(
            "decode", shape, cfg, lambda c: paged_decode_attention(*prob.decode_args(), config=c), expected
        )
        if isinstance(res, dict):
            rows.append(res)
            continue
        name = _variant_name(cfg)
        rows.append(
            _row(
                "decode",
                shape,
                name,
                res[0],
                nbytes / res[0] / 1e6,
                "GB/s",
                copy_bw,
                sdpa_ms,
                ref_ms if name == "default" else None,
                res[1],
            )
        )
    return rows


def _prefill_point(new: int, prefix: int, matmul_tflops: float, configs: list[PrefillConfig]) -> list[dict]:
    prob, q4, k4, v4 = prefill_problem(new, prefix, HQ, HKV, D, BS)
    flops = 4 * D * HQ * (new * prefix + new * (new + 1) // 2)  # causal: only the keys each row sees
    shape = f"T{new}" + (f"+prefix{prefix}" if prefix else "")
    rows, sdpa_ms, expected = [], None, None
    if prefix == 0:
        sdpa, sdpa_ms, how = _sdpa(q4, k4, v4, prob.scale, True, True)
        expected = sdpa()[0].transpose(0, 1)
        rows.append(
            _row(
                "sdpa_prefill",
                shape,
                f"causal {how}",
                sdpa_ms,
                flops / sdpa_ms / 1e9,
                "TFLOP/s",
                matmul_tflops,
            )
        )
    for cfg in configs:
        res = _time_variant(
            "prefill",
            shape,
            cfg,
            lambda c: paged_prefill_attention(*prob.prefill_args(), prob.max_seqlen_q, config=c),
            expected,
        )
        if isinstance(res, dict):
            rows.append(res)
            continue
        rows.append(
            _row(
                "prefill",
                shape,
                _variant_name(cfg),
                res[0],
                flops / res[0] / 1e9,
                "TFLOP/s",
                matmul_tflops,
                sdpa_ms,
                None,
                res[1],
            )
        )
    return rows


def _progress(rows: list[dict]) -> None:
    """One line per row as it is measured, so a run cut short still leaves its numbers in the log."""
    for r in rows:
        print(
            f"  {r['kernel']:<13}{r['shape']:<16}{r.get('variant', ''):<22}"
            f"{r.get('time_us', float('nan')):>10.1f} us"
            f"  {r.get('frac_of_ceiling', float('nan')):.3f} of ceiling  vs_sdpa={r.get('vs_sdpa')}"
            f"  err={r.get('rel_err_vs_sdpa')}  {r.get('note', '')}",
            flush=True,
        )


def bench_decode(copy_bw: float, sweep: bool) -> list[dict]:
    rows = []
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            swept = sweep and (batch, ctx) in ((64, 4096), (8, 32768))
            try:
                point = _decode_point(batch, ctx, copy_bw, DECODE_SWEEP if swept else [DecodeConfig()])
            except torch.OutOfMemoryError as exc:
                point = [{"kernel": "decode", "shape": f"B{batch}xL{ctx}", "note": f"OOM: {str(exc)[:120]}"}]
            _progress(point)
            rows += point
            torch.cuda.empty_cache()
    return rows


def bench_prefill(matmul_tflops: float, sweep: bool) -> list[dict]:
    rows = []
    for new, prefix in [(t, 0) for t in PREFILL_TOKENS] + [(2048, 6144)]:  # last: a 2k chunk after 6k cached
        point = _prefill_point(
            new, prefix, matmul_tflops, PREFILL_SWEEP if sweep and new == 8192 else [PrefillConfig()]
        )
        _progress(point)
        rows += point
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results", help="folder for the CSV")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-shape sweeps")
    parser.add_argument("--only", choices=["decode", "prefill", "blocks"], help="run one section")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M")
    start = time.time()
    copy_bw, matmul_tflops = ceilings()
    print(f"{device} | torch {torch.__version__} | triton {triton.__version__} | {date} UTC")
    print(f"ceilings: copy {copy_bw:.0f} GB/s (read+write), bf16 matmul {matmul_tflops:.0f} TFLOP/s")
    rows = [
        _row("ceiling", "copy 4GiB", "torch copy_", 0.0, copy_bw, "GB/s", copy_bw),
        _row("ceiling", "matmul 8192^3", "torch bf16", 0.0, matmul_tflops, "TFLOP/s", matmul_tflops),
    ]
    if args.only in (None, "decode"):
        rows += bench_decode(copy_bw, not args.no_sweep)
    if args.only in (None, "prefill"):
        rows += bench_prefill(matmul_tflops, not args.no_sweep)
    if args.only in (None, "blocks"):
        point = [_row(**r) for r in block_ops_rows(copy_bw)]
        _progress(point)
        rows += point
    kernel_report()
    table = pd.DataFrame(rows)
    table.insert(0, "device", device)
    table.insert(1, "date", date)
    table["torch"], table["triton"] = torch.__version__, triton.__version__
    stamp = date.replace(":", "")
    path = f"{args.out}/bench_kernels_{device.replace(' ', '_')}_{stamp}.csv"
    table.to_csv(path, index=False)
    cols = [
        "kernel",
        "shape",
        "variant",
        "time_us",
        "achieved",
        "unit",
        "frac_of_ceiling",
        "vs_sdpa",
        "vs_reference",
        "rel_err_vs_sdpa",
        "note",
    ]
    with pd.option_context("display.max_rows", 500, "display.width", 220, "display.max_colwidth", 60):
        print(table[cols].to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print(f"wrote {path} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
