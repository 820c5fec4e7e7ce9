"""Decode design sweep on a CUDA GPU: `python -m experiments.lab.bench_kernels_sweep [--per-head | --waves |
--tiles | --streams | --tma | --lead | --order] [--out DIR]`.

`--order`: the per-head and Gluon TMA kernels on ragged batches, launched longest first.
`--lead`: the Gluon TMA kernel (query heads as the MMA's N) over how far ahead it refills.
`--tma`: the Gluon TMA kernel (kernels/decode_tma.py): its tile, ring depth and warps at
B64x4k, its loads alone against the whole kernel on two storage layouts, its best settings elsewhere.
These three live in experiments/lab/bench_kernels_sweep_tma.py.

`--streams`: the per-head kernel on three cache storage layouts (block-major NHD, 4 KB
HND pages, head-major) with random and sequential block tables.  Head-major storage with
sequential tables makes each program's K and V one contiguous run, the exact stream SDPA reads.

`--waves`: batches whose 8 KV heads make whole or partial per-SM program counts (33, 64,
66, 128, 132 sequences x 4k; 132 SMs): does the per-head kernel's deficit against SDPA come from
512 programs loading 116 SMs with 4 and 16 with 3 (then it vanishes at 66 and 132), or from its
streaming rate (then it stays)?

`--per-head`: the per-KV-head kernel's tile, pipeline depth and
split count at batch 64 x 4k, SDPA timed before and after; then the three fastest at the other
grid points and the ragged batch.  ncu showed the point as a wave-balance question: 512 programs
(64 sequences x 8 KV heads, no split) on 132 SMs leave some SMs a program short at the end.

No flag: the per-KV-head kernel (kernels/decode.py) against the packed kernel
(kernels/decode_packed.py: all KV heads of a page per tile, TMA or pointer loads, even split of
the batch's tiles over a fixed grid) at batch 64 x 4k first, with SDPA on contiguous K/V as the
bar; then the three fastest packed variants at the other grid points and a ragged engine-like
batch (256 sequences of 100..2000 tokens).  Also times both kernels on a cache whose block tables
are sequential (block i of sequence s = s * blocks + i), to separate the page scatter's cost from
the kernel's.  Prints one line per row and writes a CSV to --out.
"""

import argparse
from dataclasses import replace

import pandas as pd
import torch
import torch.nn.functional as F

from experiments.lab.bench_kernels_sweep_tma import lead_round, order_round, tma_round
from experiments.lab.decode_points import (
    BS,
    HKV,
    HQ,
    PER_HEAD,
    D,
    name,
    ragged,
    sequential_tables,
    time_point,
    uniform,
)
from experiments.lib.kernel_cases import decode_problem, kernel_report
from experiments.lib.kernel_timing import copies_for, copy_gbps, graph_ms, run_stamp
from kernels import decode_packed
from kernels.decode import DecodeConfig
from kernels.decode_packed import PackedDecodeConfig as P
from kernels.inputs import KV_LAYOUTS, kv_cache_storage

CANDIDATES = [
    P(), P(num_warps=8), P(num_stages=4), P(use_tma=False),
    P(block_n=8, num_stages=4, programs_per_sm=2), P(block_n=8, num_stages=3, programs_per_sm=3),
    P(block_n=8, num_stages=5), P(block_n=8, num_stages=6), P(block_n=8, num_stages=4, programs_per_sm=2, num_warps=8),
    P(block_n=8, num_stages=4, programs_per_sm=2, use_tma=False),
]  # fmt: skip
OTHER_POINTS = [(64, 32768), (256, 1024), (8, 32768), (1, 32768), (256, 512), (8, 4096), (1, 4096), (1, 512),
                (64, 512)]  # fmt: skip


PER_HEAD_GRID = [DecodeConfig(block_n=n, num_stages=st, num_splits=sp, num_warps=w)
                 for n in (16, 32, 64) for st in (2, 3, 4) for sp in (1, 2, 3, 4) for w in (4,)
                 if not (n == 64 and st == 4)] + [DecodeConfig(num_stages=3, num_warps=8, num_splits=sp)
                                                  for sp in (1, 2)]  # fmt: skip


def merge_only_us(cfg: P) -> float:
    """The merge kernel alone at B64x4k (every sequence shared by 2-3 programs): its share of a call."""
    prob = decode_problem(64, 4096, HQ, HKV, D, BS)[0]
    out = torch.empty_like(prob.q)
    programs = cfg.programs_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
    parts = (
        torch.zeros((64 + programs) * HQ, D, device="cuda"),
        torch.zeros((64 + programs) * HQ, device="cuda"),
    )
    block_n = cfg.block_n
    call = lambda: decode_packed.decode_packed_merge_kernel[(64, HQ)](
        *parts, prob.context_lens, out, 64, programs, out.stride(0), out.stride(1), NUM_HEADS=HQ,
        HEAD_DIM=D, BLOCK_D=D, BLOCK_N=block_n, BLOCK_B=64, MIN_TILES=max(1, cfg.min_split_tokens // block_n),
        BLOCK_P=16, PDL=False, num_warps=4)  # fmt: skip
    return graph_ms([call]) * 1e3


def per_head_round(save, rows: list[dict], copy_bw: float) -> None:
    save(uniform(64, 4096, copy_bw, PER_HEAD_GRID))
    save(uniform(64, 4096, copy_bw, []))  # SDPA again: the drift over the sweep
    timed = sorted((r for r in rows if r["variant"].startswith("head") and "time_us" in r), key=lambda r: r["time_us"])
    best = [c for c in PER_HEAD_GRID if name(c) in [r["variant"] for r in timed[:3]]]
    print("best per-head at B64x4k:", [name(c) for c in best], flush=True)
    save(uniform(64, 4096, copy_bw, PER_HEAD[:1] + best))  # the winners once more, beside the default
    save(ragged(copy_bw, PER_HEAD[:1] + best))
    for batch, ctx in ((64, 32768), (256, 4096), (256, 1024), (8, 4096), (1, 4096)):
        save(uniform(batch, ctx, copy_bw, PER_HEAD[:1] + best))


WAVE_BATCHES = (33, 64, 66, 128, 132)
# --tiles: cuDNN's shape (128-key tiles, 2 programs per SM) and narrower programs (2 warps).
TILE_GRID = [DecodeConfig(block_n=n, num_stages=st, num_warps=w, num_splits=1)
             for n, st, w in ((128, 2, 4), (128, 2, 8), (64, 2, 8), (64, 3, 8), (32, 3, 2), (32, 4, 2), (16, 4, 2),
                              (32, 3, 4))]  # fmt: skip


def waves_round(save, copy_bw: float) -> None:
    for batch in WAVE_BATCHES:
        save(uniform(batch, 4096, copy_bw, [replace(c, num_splits=1) for c in PER_HEAD] + [P()]))


def tiles_round(save, copy_bw: float) -> None:
    save(uniform(64, 4096, copy_bw, TILE_GRID))
    save(uniform(64, 32768, copy_bw, TILE_GRID))


def streams_round(save, copy_bw: float) -> None:
    """The per-head kernel at B64x4k on each storage layout with random and sequential
    block tables.  headmajor + sequential reads exactly the bytes SDPA reads, in the same order per
    (sequence, head): if it still trails SDPA, no cache layout closes the gap and the kernel's
    instruction stream is the limit."""
    batch, ctx = 64, 4096
    kv = 2 * batch * ctx * HKV * D * 2
    nbytes = kv + 2 * batch * HQ * D * 2
    sets = [decode_problem(batch, ctx, HQ, HKV, D, BS, seed=i) for i in range(copies_for(kv))]
    configs = [replace(c, num_splits=1) for c in PER_HEAD]
    save(time_point("B64xL4096-nhd", sets, nbytes, copy_bw, configs))
    expected = F.scaled_dot_product_attention(sets[0][0].q.unsqueeze(2), sets[0][1], sets[0][2],
                                              scale=sets[0][0].scale, enable_gqa=True).squeeze(2)
    tables = [s[0].block_tables for s in sets]
    for layout in KV_LAYOUTS:
        for s in sets:
            s[0].k_cache, s[0].v_cache = kv_cache_storage(s[0].k_cache, layout), kv_cache_storage(s[0].v_cache, layout)
            torch.cuda.empty_cache()
        if layout != "nhd":
            save(time_point(f"B64xL4096-{layout}", sets, nbytes, copy_bw, configs, sdpa=False, expected=expected))
        for s in sets:
            sequential_tables(s[0])
        save(time_point(f"B64xL4096-{layout}-seqtab", sets, nbytes, copy_bw, configs, sdpa=False))
        for s, t in zip(sets, tables):
            s[0].block_tables = t
    save(time_point("B64xL4096-end", sets, nbytes, copy_bw, []))  # SDPA again: drift over the round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_kernels_sweep")
    parser.add_argument("--per-head", action="store_true", help="the per-head kernel's grid")
    parser.add_argument("--waves", action="store_true", help="batches of whole and partial waves")
    parser.add_argument("--tiles", action="store_true", help="128-key tiles, 2-warp programs")
    parser.add_argument("--streams", action="store_true", help="storage layouts x block-table order")
    parser.add_argument("--tma", action="store_true", help="the Gluon TMA kernel")
    parser.add_argument("--lead", action="store_true", help="TMA kernel, a ring deeper than its lead")
    parser.add_argument("--order", action="store_true", help="ragged batches launched longest first")
    args = parser.parse_args()
    stamp = run_stamp()
    device, date = stamp.device, stamp.date
    copy_bw = copy_gbps()
    print(f"copy {copy_bw:.0f} GB/s (read+write)")
    path = stamp.csv(args.out, "bench_kernels_sweep")
    rows: list[dict] = []

    def save(new_rows: list[dict]) -> None:  # after every point: a run cut short keeps its numbers
        rows.extend(new_rows)
        table = pd.DataFrame(rows)
        table.insert(0, "device", device)
        table.insert(1, "date", date)
        table.to_csv(path, index=False)

    if args.per_head:
        per_head_round(save, rows, copy_bw)
        return
    if args.waves:
        waves_round(save, copy_bw)
        return
    if args.tiles:
        tiles_round(save, copy_bw)
        return
    if args.streams:
        streams_round(save, copy_bw)
        return
    if args.tma or args.lead or args.order:
        (tma_round if args.tma else lead_round if args.lead else order_round)(save, rows, copy_bw)
        return
    save(uniform(64, 4096, copy_bw, PER_HEAD + CANDIDATES))
    packed = sorted((r for r in rows if r["variant"].startswith("packed") and "time_us" in r),
                    key=lambda r: r["time_us"])  # fmt: skip
    best = [c for c in CANDIDATES if name(c) in [r["variant"] for r in packed[:3]]]
    print("best packed at B64x4k:", [name(c) for c in best], flush=True)
    merge_us = merge_only_us(best[0])
    print(f"merge kernel alone at B64x4k: {merge_us:.1f} us", flush=True)
    save([{"shape": "B64xL4096", "variant": "merge-only-" + name(best[0]), "time_us": merge_us}])
    save(uniform(64, 4096, copy_bw, PER_HEAD[:1] + best[:1] + [replace(best[0], pdl=False)], sequential=True))
    save(ragged(copy_bw, PER_HEAD[:1] + best))
    for batch, ctx in OTHER_POINTS:
        finer = [replace(best[0], min_split_tokens=n) for n in (32, 64)] if batch <= 8 else []
        save(uniform(batch, ctx, copy_bw, PER_HEAD[:1] + best + finer))
    kernel_report()


if __name__ == "__main__":
    main()
