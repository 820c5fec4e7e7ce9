"""Benchmark of the paged-attention kernels on a CUDA GPU: `python -m experiments.bench_kernels`.

Measures the device's ceilings first (device-to-device copy bandwidth, bf16 matmul rate on random
data), then: decode over a batch x context grid (Qwen3-0.6B attention: 16 q heads, 8 KV heads,
head_dim 128, block_size 16, bf16) against SDPA on the same KV laid out contiguously and against
the plain-torch paged reference, for the three decode kernels (the per-KV-head default, the packed
one and the Gluon TMA one), plus a ragged engine-like batch (256 sequences of 100..2000 tokens,
launched longest first); prefill of single prompts (causal) against SDPA; KV write, block copy and swap.  A sweep of variants runs at the
target points (decode 64 x 4k, small batches; prefill 8k); every variant is checked against SDPA
(or the float64 reference) before it is timed.  Kernels and SDPA are timed from CUDA-graph replays
(experiments/lib/kernel_timing.py).  Prints one table and writes it as CSV with device and date to --out (default
outputs/bench_kernels/), rewritten after every point.
"""

import argparse
import time
from collections.abc import Callable

import pandas as pd
import torch
import torch.nn.functional as F

from experiments.lib.kernel_cases import (
    block_ops_rows,
    decode_problem,
    kernel_report,
    prefill_problem,
    ragged_decode_problem,
)
from experiments.lib.kernel_timing import bench_ms, copies_for, copy_gbps, graph_ms, matmul_tflops, run_stamp
from kernels import reference
from kernels.decode import DecodeConfig, paged_decode_attention
from kernels.decode_packed import PackedDecodeConfig
from kernels.decode_tma import TmaDecodeConfig
from kernels.prefill import PrefillConfig, paged_prefill_attention

HQ, HKV, D, BS = 16, 8, 128, 16
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (512, 1024, 4096, 32768)
PREFILL_TOKENS = (512, 1024, 2048, 4096, 8192)
REFERENCE_MAX_TOKENS = 64 * 4096  # the per-sequence torch reference is slow and memory-hungry
# Every decode point times the per-KV-head kernel, the packed one (PackedDecodeConfig()) and the
# Gluon TMA one (docs/kernels.md); these variants run at the points named.
PACKED = PackedDecodeConfig()
TMA = TmaDecodeConfig()  # the Gluon TMA kernel, timed at every point too
DECODE_SWEEP = {
    (64, 4096): [
        DecodeConfig(num_stages=3), PackedDecodeConfig(pdl=False),
        PackedDecodeConfig(block_n=8, num_stages=4, programs_per_sm=2),
    ],
    (256, 1024): [DecodeConfig(num_stages=3)],
}  # fmt: skip
SMALL_BATCH_SWEEP = [PackedDecodeConfig(min_split_tokens=64), PackedDecodeConfig(min_split_tokens=256)]
PREFILL_SWEEP = [
    PrefillConfig(num_stages=3), PrefillConfig(num_stages=2), PrefillConfig(block_n=64, num_stages=4),
    PrefillConfig(num_stages=3, pack_gqa=False),
]  # fmt: skip


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _row(kernel, shape, variant, ms, metric, unit, ceiling, sdpa_ms=None, ref_ms=None, err=None, note=""):
    """One table row; vs_sdpa / vs_reference are speed-ups (their time over ours)."""
    return {
        "kernel": kernel, "shape": shape, "variant": variant, "time_us": ms * 1e3, "achieved": metric,
        "unit": unit, "frac_of_ceiling": metric / ceiling, "vs_sdpa": (sdpa_ms / ms) if sdpa_ms else None,
        "vs_reference": (ref_ms / ms) if ref_ms else None, "rel_err_vs_sdpa": err, "note": note,
    }  # fmt: skip


def _variant_name(cfg: DecodeConfig | PackedDecodeConfig | TmaDecodeConfig | PrefillConfig) -> str:
    if cfg in (DecodeConfig(), PrefillConfig()):
        return "default"
    if isinstance(cfg, TmaDecodeConfig):
        lead = "" if cfg.lead is None else f"l{cfg.lead}"
        return f"tma-t{cfg.tile_tokens}b{cfg.num_bufs}{lead}w{cfg.num_warps}sp{cfg.num_splits or 'auto'}"
    if isinstance(cfg, DecodeConfig):
        hint = f"-{cfg.kv_eviction}" if cfg.kv_eviction else ""
        return f"per-head-n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}sp{cfg.num_splits or 'auto'}{hint}"
    if isinstance(cfg, PackedDecodeConfig):
        io = ("tma" if cfg.use_tma else "ptr") + ("" if cfg.pdl else "-nopdl")
        return (f"packed-n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}pp{cfg.programs_per_sm}"
                f"min{cfg.min_split_tokens}-{io}")  # fmt: skip
    return f"m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}" + (
        "" if cfg.pack_gqa else "-nopack"
    )


def _time_variants(kernel, shape, configs, call, problems, expected, row_of, prefix="") -> list[dict]:
    """Check each config against `expected` on problems[0], then time it rotating over problems.
    A variant that fails (e.g. too much shared memory) becomes an error row, not a crash."""
    rows = []
    for cfg in configs:
        try:
            err = _rel_err(call(problems[0], cfg), expected) if expected is not None else None
            ms = graph_ms([lambda p=p, c=cfg: call(p, c) for p in problems])
        except Exception as exc:  # noqa: BLE001
            rows.append({"kernel": kernel, "shape": shape, "variant": prefix + _variant_name(cfg),
                         "note": f"error: {type(exc).__name__}: {str(exc)[:160]}"})  # fmt: skip
            continue
        rows.append(row_of(cfg, ms, err))
    return rows


def _decode_point(batch: int, ctx: int, copy_bw: float, configs: list) -> list[dict]:
    shape, kv_bytes = f"B{batch}xL{ctx}", 2 * batch * ctx * HKV * D * 2
    nbytes = kv_bytes + 2 * batch * HQ * D * 2
    sets = [decode_problem(batch, ctx, HQ, HKV, D, BS, seed=i) for i in range(copies_for(kv_bytes))]
    note = f"rotates {len(sets)} copies" if len(sets) > 1 else ""

    def sdpa(s):
        return F.scaled_dot_product_attention(
            s[0].q.unsqueeze(2), s[1], s[2], scale=s[0].scale, enable_gqa=True
        )

    sdpa_ms = graph_ms([lambda s=s: sdpa(s) for s in sets])
    expected = sdpa(sets[0]).squeeze(2)
    ref_ms = None
    if batch * ctx <= REFERENCE_MAX_TOKENS:
        ref_ms = bench_ms(lambda: reference.paged_decode_attention(*sets[0][0].decode_args()), rep=50)
    gbps = nbytes / sdpa_ms / 1e6
    rows = [_row("sdpa_decode", shape, "contiguous enable_gqa", sdpa_ms, gbps, "GB/s", copy_bw, note=note)]

    def row_of(cfg, ms, err):
        name = _variant_name(cfg)
        ref = ref_ms if name == "default" else None
        return _row("decode", shape, name, ms, nbytes / ms / 1e6, "GB/s", copy_bw, sdpa_ms, ref, err, note)

    call = lambda s, c: paged_decode_attention(*s[0].decode_args(), config=c)
    return rows + _time_variants("decode", shape, configs, call, sets, expected, row_of)


def _ragged_decode_point(copy_bw: float) -> list[dict]:
    """The engine's kind of batch: 256 sequences of 100..2000 tokens (no SDPA: it needs equal
    lengths), launched longest first as the engine does; errors are against the float64
    reference."""
    prob = ragged_decode_problem(256, 100, 2000, HQ, HKV, D, BS)
    nbytes = 2 * int(prob.context_lens.sum()) * HKV * D * 2 + 2 * 256 * HQ * D * 2
    expected = reference.paged_decode_attention(*prob.to(torch.float64).decode_args())
    shape = "B256xL100..2000"

    def row_of(cfg, ms, err):
        return _row(
            "decode", shape, _variant_name(cfg), ms, nbytes / ms / 1e6, "GB/s", copy_bw, None, None, err
        )

    order = torch.argsort(prob.context_lens, descending=True).to(torch.int32)
    call = lambda p, c: paged_decode_attention(*p.decode_args(), config=c, order=order)
    return _time_variants("decode", shape, [DecodeConfig(), PACKED, TMA], call, [prob], expected, row_of)


def _prefill_point(new: int, prefix: int, matmul: float, configs: list[PrefillConfig]) -> list[dict]:
    flops = 4 * D * HQ * (new * prefix + new * (new + 1) // 2)  # causal: only the keys each row sees
    shape = f"T{new}" + (f"+prefix{prefix}" if prefix else "")
    sets = [
        prefill_problem(new, prefix, HQ, HKV, D, BS, seed=i)
        for i in range(copies_for(4 * new * HQ * D * 2, 8))
    ]
    rows, sdpa_ms, expected = [], None, None
    if prefix == 0:  # SDPA with enable_gqa, or with K/V repeated to every q head: the faster is the baseline
        reps = [(s[2].repeat_interleave(HQ // HKV, 1), s[3].repeat_interleave(HQ // HKV, 1)) for s in sets]
        gqa = [lambda s=s: F.scaled_dot_product_attention(s[1], s[2], s[3], is_causal=True, enable_gqa=True)
               for s in sets]  # fmt: skip
        rep = [lambda s=s, r=r: F.scaled_dot_product_attention(s[1], r[0], r[1], is_causal=True)
               for s, r in zip(sets, reps, strict=True)]  # fmt: skip
        sdpa_ms, how, fns = min(
            (graph_ms(fns), how, fns) for how, fns in (("enable_gqa", gqa), ("repeat_kv", rep))
        )
        expected = fns[0]()[0].transpose(0, 1)
        rows.append(
            _row("sdpa_prefill", shape, f"causal {how}", sdpa_ms, flops / sdpa_ms / 1e9, "TFLOP/s", matmul)
        )

    def row_of(cfg, ms, err):
        return _row(
            "prefill", shape, _variant_name(cfg), ms, flops / ms / 1e9, "TFLOP/s", matmul, sdpa_ms, None, err
        )

    call = lambda s, c: paged_prefill_attention(*s[0].prefill_args(), s[0].max_seqlen_q, config=c)
    return rows + _time_variants("prefill", shape, configs, call, sets, expected, row_of)


def _progress(rows: list[dict]) -> None:
    """One line per row as it is measured, so a run cut short still leaves its numbers in the log."""
    for r in rows:
        us, frac = r.get("time_us", float("nan")), r.get("frac_of_ceiling", float("nan"))
        print(f"  {r['kernel']:<13}{r['shape']:<17}{r.get('variant', ''):<20}{us:>9.1f} us"
              f"  {frac:.3f} of ceiling  vs_sdpa={r.get('vs_sdpa')}"
              f"  err={r.get('rel_err_vs_sdpa')}  {r.get('note', '')}", flush=True)  # fmt: skip


def bench_decode(copy_bw: float, sweep: bool, save: Callable[[list[dict]], None]) -> None:
    point = _ragged_decode_point(copy_bw)
    _progress(point)
    save(point)
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            if ctx == 1024 and batch != 256:
                continue  # 256 x 1k: the engine's decode step in bench_throughput
            configs = [DecodeConfig(), PACKED, TMA]
            if sweep:
                configs += DECODE_SWEEP.get((batch, ctx), []) + (SMALL_BATCH_SWEEP if batch <= 8 else [])
            try:
                point = _decode_point(batch, ctx, copy_bw, configs)
            except torch.OutOfMemoryError as exc:
                point = [{"kernel": "decode", "shape": f"B{batch}xL{ctx}", "note": f"OOM: {str(exc)[:120]}"}]
            _progress(point)
            save(point)
            torch.cuda.empty_cache()


def bench_prefill(matmul: float, sweep: bool) -> list[dict]:
    rows = []
    for new, prefix in [(t, 0) for t in PREFILL_TOKENS] + [(2048, 6144)]:  # last: a 2k chunk after 6k cached
        point = _prefill_point(
            new, prefix, matmul, [PrefillConfig(), *(PREFILL_SWEEP if sweep and new == 8192 else [])]
        )
        _progress(point)
        rows += point
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_kernels", help="folder for the CSV")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-shape sweeps")
    parser.add_argument("--only", choices=["decode", "prefill", "blocks"], help="run one section")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    stamp = run_stamp()
    start = time.time()
    copy_bw, matmul = copy_gbps(), matmul_tflops()
    print(f"ceilings: copy {copy_bw:.0f} GB/s (read+write), bf16 matmul {matmul:.0f} TFLOP/s")
    path = stamp.csv(args.out, "bench_kernels")
    save = stamp.csv_writer(args.out, "bench_kernels")

    save([_row("ceiling", "copy 2GiB", "torch copy_", 0.0, copy_bw, "GB/s", copy_bw),
          _row("ceiling", "matmul 8192^3", "torch bf16", 0.0, matmul, "TFLOP/s", matmul)])  # fmt: skip
    if args.only in (None, "decode"):
        bench_decode(copy_bw, not args.no_sweep, save)
    if args.only in (None, "prefill"):
        save(bench_prefill(matmul, not args.no_sweep))
    if args.only in (None, "blocks"):
        point = [_row(**r) for r in block_ops_rows(copy_bw)]
        _progress(point)
        save(point)
    save([_row("ceiling", "matmul 8192^3 (again)", "torch bf16", 0.0, matmul_tflops(), "TFLOP/s", matmul)])
    kernel_report()
    table = pd.read_csv(path)
    cols = ["kernel", "shape", "variant", "time_us", "achieved", "unit", "frac_of_ceiling", "vs_sdpa",
            "vs_reference", "rel_err_vs_sdpa", "note"]  # fmt: skip
    with pd.option_context("display.max_rows", 500, "display.width", 250, "display.max_colwidth", 40):
        print(table[cols].to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print(f"wrote {path} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
