"""The Gluon TMA decode kernel's sweeps, `python -m experiments.lab.bench_kernels_sweep --tma | --lead |
--order`: the
Gluon TMA decode kernel (kernels/decode_tma.py) over tile, ring depth, lead and warps at B64x4k
beside the per-head kernel and SDPA, its loads alone (math skipped), then its fastest settings at
the other grid points; the launch order of ragged batches.  Problem timing: decode_points.py.
"""

from dataclasses import replace

import torch

from experiments.lab.decode_points import (
    BS,
    HKV,
    HQ,
    PER_HEAD,
    D,
    P,
    name,
    ragged,
    sequential_tables,
    uniform,
)
from experiments.lib.kernel_cases import decode_problem
from experiments.lib.kernel_timing import copies_for, graph_ms
from kernels.decode import DecodeConfig, paged_decode_attention
from kernels.decode_splits import choose_num_splits, merge_splits, split_partials
from kernels.decode_tma import TmaDecodeConfig, paged_decode_tma
from kernels.inputs import kv_cache_storage, random_paged_problem

TMA_GRID = [TmaDecodeConfig(tile_tokens=t, num_bufs=n, lead=None, num_splits=sp, num_warps=w)
            for t, n, w, sp in ((32, 2, 1, 1), (32, 2, 4, 1), (32, 2, 2, 1), (32, 3, 4, 1), (32, 3, 1, 1), (16, 3, 4, 1),
                                (16, 4, 1, 1), (16, 6, 4, 1), (64, 2, 8, 1), (64, 2, 4, 2))]  # fmt: skip


def loads_only_rows(label: str, sets, configs) -> list[dict]:
    """The TMA kernel with and without its math (loads, waits and refills only: wrong results,
    timing only), rotating over the problem copies."""
    rows = []
    out = torch.empty_like(sets[0][0].q)
    for cfg in configs:
        for math in (True, False):
            fns = [lambda s=s, c=cfg, m=math: paged_decode_tma(*s[0].decode_args(), out, out, out, 1, c, math=m) for s in sets]
            variant = name(cfg) + ("" if math else "-loadsonly")
            rows.append({"shape": label, "variant": variant, "time_us": graph_ms(fns) * 1e3})
            print(f"  {label:<24}{variant:<36}{rows[-1]['time_us']:>9.1f} us", flush=True)
    return rows


def tma_round(save, rows: list[dict], copy_bw: float) -> None:
    """`--tma`: the Gluon TMA kernel (kernels/decode_tma.py) at B64x4k over tile, ring depth and
    warps beside the per-head kernel and SDPA (timed before and after); its loads alone (no math) on
    block-major (NHD) and HND storage with random and sequential block tables; then the two fastest,
    with the split heuristic, at the other grid points and the ragged batch."""
    per_head = [replace(c, num_splits=1) for c in PER_HEAD]
    save(uniform(64, 4096, copy_bw, per_head + TMA_GRID))
    save(uniform(64, 4096, copy_bw, []))
    timed = sorted((r for r in rows if r["variant"].startswith("tma") and "time_us" in r), key=lambda r: r["time_us"])
    best = [replace(c, num_splits=None) for c in TMA_GRID if name(c) in [r["variant"] for r in timed[:2]]]
    print("best TMA at B64x4k:", [name(c) for c in best], flush=True)
    kv = 2 * 64 * 4096 * HKV * D * 2
    sets = [decode_problem(64, 4096, HQ, HKV, D, BS, seed=i) for i in range(copies_for(kv))]
    tables = [s[0].block_tables for s in sets]
    loads = [TmaDecodeConfig(num_splits=1, lead=None, num_warps=w) for w in (1, 4)]
    for layout in ("nhd", "hnd"):
        for s, t in zip(sets, tables):
            s[0].block_tables = t
            s[0].k_cache, s[0].v_cache = kv_cache_storage(s[0].k_cache, layout), kv_cache_storage(s[0].v_cache, layout)
        save(loads_only_rows(f"B64xL4096-{layout}", sets, loads))
        for s in sets:
            sequential_tables(s[0])
        save(loads_only_rows(f"B64xL4096-{layout}-seqtab", sets, loads))
    del sets
    torch.cuda.empty_cache()
    save(uniform(64, 4096, copy_bw, PER_HEAD + best))
    save(ragged(copy_bw, PER_HEAD[:1] + best + [P()]))
    for batch, ctx in ((64, 32768), (256, 4096), (256, 1024), (8, 32768), (8, 4096), (1, 32768), (1, 4096), (64, 512)):
        save(uniform(batch, ctx, copy_bw, PER_HEAD[:1] + best))


LEAD_GRID = [TmaDecodeConfig(tile_tokens=t, num_bufs=n, lead=ld, num_splits=1, num_warps=w)
             for t, n, ld, w in ((32, 2, 1, 1), (32, 2, None, 1), (32, 3, 2, 1), (32, 3, 1, 1), (16, 2, 1, 1),
                                 (16, 3, 2, 1), (32, 2, 1, 2), (32, 2, 1, 4))]  # fmt: skip


def lead_round(save, rows: list[dict], copy_bw: float) -> None:
    """`--lead`: the Gluon TMA kernel with query heads as the MMA's N, over how far ahead it refills
    (`lead`: an int refills the buffer read in the step before ahead of each step's wait; None refills
    a step's own buffer once read), ring depth, tile and warps at B64x4k, SDPA timed before and after;
    the first three with and without their math; then the fastest at the other grid points."""
    per_head = [replace(c, num_splits=1) for c in PER_HEAD[1:]]
    save(uniform(64, 4096, copy_bw, per_head + LEAD_GRID))
    kv = 2 * 64 * 4096 * HKV * D * 2
    sets = [decode_problem(64, 4096, HQ, HKV, D, BS, seed=i) for i in range(copies_for(kv))]
    save(loads_only_rows("B64xL4096", sets, LEAD_GRID[:3]))
    del sets
    torch.cuda.empty_cache()
    save(uniform(64, 4096, copy_bw, LEAD_GRID[:2]))
    here = [r for r in rows if r["shape"] == "B64xL4096" and r["variant"].startswith("tma") and "frac_copy" in r]
    timed = sorted(here, key=lambda r: r["time_us"])
    best = [replace(c, num_splits=None) for c in LEAD_GRID if name(c) in [r["variant"] for r in timed[:2]]]
    print("best TMA at B64x4k:", [name(c) for c in best], flush=True)
    save(ragged(copy_bw, PER_HEAD[:1] + best + [P()]))
    for batch, ctx in ((64, 32768), (256, 4096), (8, 4096), (1, 32768), (64, 512)):
        save(uniform(batch, ctx, copy_bw, PER_HEAD[:1] + best))


ORDER_CASES = [(256, 100, 2000), (64, 100, 2000), (128, 100, 4000), (64, 100, 8000), (32, 500, 8000), (256, 16, 4000)]


def order_round(save, rows: list[dict], copy_bw: float) -> None:
    """`--order`: the launch order of ragged batches (`ORDER_CASES`: batch, shortest, longest context)."""
    for batch, low, high in ORDER_CASES:
        save(_order_case(batch, low, high, copy_bw))
        torch.cuda.empty_cache()


def _order_case(batch: int, low: int, high: int, copy_bw: float) -> list[dict]:
    """The packed kernel; the per-head kernel in batch order and longest first (its launcher drops the
    order within one wave); the Gluon TMA kernel at 1, 2 and the heuristic's splits, in batch order,
    longest first forced (launched directly, the one-wave rule bypassed), and longest first with the
    order sorted on the GPU in every call."""
    lens = torch.randint(low, high + 1, (batch,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = 2 * sum(lens) * HKV * D * 2
    sets = [random_paged_problem(lens, None, HQ, HKV, D, BS, torch.bfloat16, device="cuda", seed=i)
            for i in range(copies_for(kv))]  # fmt: skip
    orders = [torch.argsort(s.context_lens, descending=True).to(torch.int32) for s in sets]
    label = f"B{batch}x{low}..{high}"
    rows: list[dict] = []

    def add(variant: str, fns) -> None:
        ms = graph_ms(fns)
        rows.append({"shape": label, "variant": variant, "time_us": ms * 1e3, "GBps": kv / ms / 1e6,
                     "frac_copy": kv / ms / 1e6 / copy_bw})  # fmt: skip
        print(f"  {label:<20}{variant:<36}{ms * 1e3:>9.1f} us", flush=True)

    def public(cfg, ordered: bool):
        return [lambda s=s, o=o: paged_decode_attention(*s.decode_args(), config=cfg, order=o if ordered else None)
                for s, o in zip(sets, orders)]  # fmt: skip

    add(name(P()), public(P(), False))
    add(name(DecodeConfig()), public(DecodeConfig(), False))
    add(name(DecodeConfig()) + "-longest", public(DecodeConfig(), True))
    for splits in (1, 2, None):
        cfg = TmaDecodeConfig(num_splits=splits)
        n = choose_num_splits(batch, HKV, sets[0].block_tables.shape[1] * BS, sets[0].q.device, cfg)
        out = torch.empty_like(sets[0].q)
        parts = split_partials(out, n, D)

        def direct(s, order, c=cfg, n=n, parts=parts, out=out):
            paged_decode_tma(*s.decode_args(), out, *parts, n, c, order=order)
            merge_splits(*parts, out, n, D)

        tag = f"{name(cfg)}-n{n}"
        add(tag, [lambda s=s: direct(s, None) for s in sets])
        add(tag + "-longest", [lambda s=s, o=o: direct(s, o) for s, o in zip(sets, orders)])
        add(tag + "-longest-sorted", [lambda s=s: direct(s, torch.argsort(s.context_lens, descending=True).int())
                                      for s in sets])  # fmt: skip
    return rows
