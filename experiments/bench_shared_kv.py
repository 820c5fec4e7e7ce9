"""What a decode re-read of a shared KV block costs on this GPU: `python -m experiments.bench_shared_kv`.

The simulator prices a decode batch's KV entries that another sequence of the batch also reads (a
cached prefix, a forked prompt) at `Hardware.kv_reread_cost` = hbm_bandwidth / l2_bandwidth of a
fresh read (conf/hardware/*.yaml, docs/architecture.md). This benchmark measures it for the
engine's decode kernel (the one `decode_kernel=auto` resolves to) on Qwen3-0.6B's attention shape:
for each batch, the same decode problem twice, once with every sequence's blocks distinct and once
with the first `prefix` tokens of the sequences of each of `groups` groups on the same blocks,
plus the distinct problem at a longer context for the kernel's time per KV entry. Then

    cost = 1 - (t_distinct - t_shared) / (per_entry x shared entries)

(0: a re-read is free, 1: it costs a fresh read), and `l2_bandwidth` = copy bandwidth / cost for
the hardware file. Times are CUDA-graph replays rotating over enough problem copies that their data
is 3x the L2 (experiments/lib/kernel_timing.py). Prints one table and writes it as CSV to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pandas as pd
import torch

from experiments.lib.kernel_cases import decode_problem
from experiments.lib.kernel_timing import copies_for, copy_gbps, graph_ms, run_stamp

HQ, HKV, D, BS = 16, 8, 128, 16
BATCHES = (8, 16, 24, 48)
CONTEXT, PREFIX, LONGER = 1024, 768, 1536  # the fleet spec's 768-token system prompts


def share_prefix(tables: torch.Tensor, prefix_blocks: int, groups: int) -> torch.Tensor:
    """`tables` with the first `prefix_blocks` blocks of every sequence replaced by those of the
    first sequence of its group (sequence s is in group s % groups)."""
    if not 1 <= groups <= tables.shape[0]:
        raise ValueError(f"groups={groups!r} is invalid: must be in [1, {tables.shape[0]}] (the batch)")
    shared = tables.clone()
    for s in range(groups, tables.shape[0]):
        shared[s, :prefix_blocks] = tables[s % groups, :prefix_blocks]
    return shared


def shared_entries(batch: int, prefix: int, groups: int) -> int:
    """KV entries re-read from blocks an earlier sequence of the batch reads."""
    return (batch - groups) * prefix


def reread_cost(t_distinct: float, t_shared: float, t_longer: float, batch: int, extra_ctx: int,
                shared: int) -> float:
    """The cost of a shared entry as a fraction of a fresh one, from the times of the distinct
    problem, the shared one, and the distinct one `extra_ctx` tokens longer per sequence."""
    per_entry = (t_longer - t_distinct) / (batch * extra_ctx)
    if per_entry <= 0 or shared <= 0:
        raise ValueError(f"no time per KV entry to compare with (t {t_distinct} -> {t_longer} ms over "
                         f"{batch} x {extra_ctx} entries; {shared} shared entries)")
    return 1.0 - (t_distinct - t_shared) / (per_entry * shared)


def _kernel_call(device: torch.device):
    from engine.device.attention import resolve_decode_kernel
    from kernels.decode import paged_decode_attention
    from kernels.decode_packed import PackedDecodeConfig
    from kernels.decode_tma import TmaDecodeConfig
    name = resolve_decode_kernel("auto", device, torch.bfloat16, D, HQ // HKV, BS)
    config = {"tma": TmaDecodeConfig(), "packed": PackedDecodeConfig()}.get(name)
    return name, lambda p: paged_decode_attention(*p.decode_args(), config=config)


def _time(problems, call) -> float:
    return graph_ms([lambda p=p: call(p) for p in problems])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_shared_kv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="1,4", help="comma-separated numbers of shared prefixes per batch")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_shared_kv"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: bench_shared_kv times CUDA kernels: run it on a GPU")
    groups_list = [int(g) for g in args.groups.split(",")]
    device = torch.device("cuda")
    kernel, call = _kernel_call(device)
    stamp, bw = run_stamp(), copy_gbps()
    rows = []
    for batch in BATCHES:
        kv_bytes = 2 * batch * LONGER * HKV * D * 2
        copies = range(copies_for(kv_bytes))
        distinct = [decode_problem(batch, CONTEXT, HQ, HKV, D, BS, seed=i)[0] for i in copies]
        longer = [decode_problem(batch, LONGER, HQ, HKV, D, BS, seed=i)[0] for i in copies]
        t_distinct, t_longer = _time(distinct, call), _time(longer, call)
        for groups in (g for g in groups_list if g < batch):
            shared = [dataclasses.replace(p, block_tables=share_prefix(p.block_tables, PREFIX // BS, groups))
                      for p in distinct]
            t_shared = _time(shared, call)
            n = shared_entries(batch, PREFIX, groups)
            cost = reread_cost(t_distinct, t_shared, t_longer, batch, LONGER - CONTEXT, n)
            rows.append({"device": stamp.device, "date": stamp.date, "copy_gb_s": bw, "kernel": kernel, "batch": batch, "context": CONTEXT, "prefix": PREFIX, "groups": groups,
                         "distinct_ms": t_distinct, "shared_ms": t_shared, "longer_ms": t_longer,
                         "shared_share": n / (batch * CONTEXT), "reread_cost": cost,
                         "l2_bandwidth": bw * 1e9 / cost if cost > 0 else float("inf")})
            print(f"{kernel} B{batch} groups {groups}: distinct {t_distinct * 1e3:.1f} us, shared {t_shared * 1e3:.1f} "
                  f"us, +{LONGER - CONTEXT} ctx {t_longer * 1e3:.1f} us -> re-read cost {cost:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_shared_kv_{stamp.date.replace(':', '')}.csv"
    frame = pd.DataFrame(rows)
    frame.to_csv(path, index=False)
    print(f"copy bandwidth {bw:.0f} GB/s; median re-read cost {frame.reread_cost.median():.3f}; wrote {path}")


if __name__ == "__main__":
    main()
