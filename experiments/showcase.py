"""`python -m experiments.showcase [--out DIR] [--sections 1,2,3,4,5]`: the headline comparisons, as a markdown table in
<out>/showcase.md, runs and plots beside it (default out: outputs/showcase/<date>/<time>/; the
result of record is experiments/results/showcase.md).

1. The seed question of PagedAttention: with the same KV memory, `blocks=contiguous` (reserve
   prompt + max_tokens up front) vs `blocks=paged` on a ShareGPT-like offline batch whose requests
   may generate up to 2048 tokens but stop earlier (as real chats do): batch size, throughput,
   KV utilisation.
2. FCFS vs priority when requests queue: TTFT of the urgent class (paired bootstrap CIs).
3. Swap vs recompute preemption under memory pressure, at block sizes 16 and 64.
4. Length-aware scheduling (sjf, srpt, mlfq) under heavy-tailed output lengths, over load, with the
   oracle's and a learned predictor's lengths (experiments/lib/showcase_policies.py).
5. VTC fair share between a heavy and a light tenant, over the heavy tenant's rate.
All on the simulator with the roofline model (qwen3-0.6b on an H200, KV memory capped).
"""
from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module

from experiments.lib.ab_compare import compare
from experiments.lib.cli import run_cli
from experiments.lib.paths import write_output
from experiments.lib.run_dirs import default_run_dir
from experiments.lib.run_workload import run
from experiments.lib.showcase_policies import fair_share, length_aware

BASE = ["progress=false", "model=qwen3-0.6b", "hardware=h200", "latency=roofline", "seed=0"]
# Sections 1-3 schedule synchronously, as their run of record (experiments/results/showcase.md) did
# when that was the default.
SYNC = "scheduler.async_scheduling=false"
PAGED = ["workload=sharegpt", "workload.arrival=offline", "workload.num_requests=1000", "workload.max_tokens=2048",
         "blocks.kv_cache_gib=4", SYNC]
PRIORITY = ["workload=priority", "workload.num_requests=1000", "blocks.kv_cache_gib=4", SYNC]
PREEMPT = ["workload=sharegpt", "workload.rate=100", "workload.num_requests=1000", "blocks.kv_cache_gib=1", SYNC]


def config(overrides: Sequence[str]):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=[*BASE, *overrides])


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:,.0f} ms" if abs(x) >= 0.1 else f"{x * 1e3:.1f} ms"


def paged_vs_contiguous(out: Path, plots: bool) -> str:
    rows = []
    for kind in ("contiguous", "paged"):
        s = run(config([*PAGED, f"blocks={kind}", f"plots={plots}"]), out / f"blocks-{kind}", kind)
        rows.append(f"| `{kind}` | {s['mean_batch_size']:.1f} | {s['request_throughput']:.1f} | "
                    f"{s['output_throughput']:,.0f} | {s['kv_utilization']:.1%} | {s['kv_waste']:.1%} | "
                    f"{s['num_preemptions']} | {_ms(s['ttft']['mean'])} |")
    return ("### 1. PagedAttention vs contiguous reservation (same 4 GiB of KV)\n\n"
            "ShareGPT-like lengths (lognormal, means ~161 prompt / ~338 output tokens), 1,000 requests at t=0, "
            "`max_tokens=2048` with requests stopping at their natural length. `contiguous` reserves "
            "prompt + max_tokens per request on admission, `paged` allocates 16-token blocks on demand.\n\n"
            "| blocks | mean batch size | req/s | output tok/s | KV utilisation | KV waste | preemptions | "
            "TTFT mean |\n|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")


def fcfs_vs_priority(out: Path, plots: bool) -> str:
    cfg_a, cfg_b = (config([*PRIORITY, f"policy={p}", f"plots={plots}"]) for p in ("fcfs", "priority"))
    result = compare(cfg_a, cfg_b, out / "fcfs-vs-priority", "fcfs", "priority", resamples=1000)
    t = result.table
    rows = []
    for scope, name in (("priority=0", "urgent (priority 0, 20%)"), ("priority=1", "batch (priority 1, 80%)"),
                        ("all", "all requests")):
        for stat in ("mean", "p90"):
            r = t[(t.metric == "ttft") & (t.scope == scope) & (t.stat == stat)].iloc[0]
            rows.append(f"| {name} | TTFT {stat} | {_ms(r.a)} | {_ms(r.b)} | {r.rel_diff:+.1%} "
                        f"[{_ms(r.ci_low)}, {_ms(r.ci_high)}] |")
    a, b = result.summary_a, result.summary_b
    rows.append(f"| all requests | output tok/s | {a['output_throughput']:,.0f} | {b['output_throughput']:,.0f} | "
                f"{b['output_throughput'] / a['output_throughput'] - 1:+.1%} |")
    return ("### 2. FCFS vs priority (TTFT of the urgent class)\n\n"
            "Poisson at 150 req/s (above this setup's ~120 req/s capacity), ShareGPT-like lengths, 20% of "
            "requests urgent, 4 GiB of KV, recompute preemption; priority lets an urgent request push out "
            "running batch requests. Change with the 95% paired-bootstrap CI of the difference.\n\n"
            "| class | metric | fcfs | priority | change [95% CI of the difference] |\n|---|---|---:|---:|---|\n"
            + "\n".join(rows) + "\n")


def swap_vs_recompute(out: Path, plots: bool) -> str:
    rows = []
    for bs in (16, 64):
        for mode in ("recompute", "swap"):
            s = run(config([*PREEMPT, f"policy.preemption_mode={mode}", f"blocks.block_size={bs}", f"plots={plots}"]),
                    out / f"{mode}-bs{bs}", f"{mode} bs={bs}")
            rows.append(f"| {mode} | {bs} | {s['request_throughput']:.1f} | {s['output_throughput']:,.0f} | "
                        f"{_ms(s['e2e']['mean'])} | {_ms(s['tpot']['mean'])} | {s['num_preemptions']} | "
                        f"{s['swap_out_blocks'] + s['swap_in_blocks']:,} |")
    return ("### 3. Swap vs recompute under memory pressure\n\n"
            "Poisson at 100 req/s, ShareGPT-like lengths, only 1 GiB of KV (~9,300 tokens); swap moves blocks "
            "over a 55 GB/s host link, recompute re-runs the prefill.\n\n"
            "| preemption | block size | req/s | output tok/s | E2E mean | TPOT mean | preemptions | "
            "blocks swapped (out + in) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")


def _main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m experiments.showcase", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="runs dir (default outputs/showcase/<date>/<time>)")
    parser.add_argument("--result", type=Path, default=None, help="markdown file to write (default <out>/showcase.md)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--sections", default="1,2,3,4,5", help="comma-separated section numbers (default all)")
    args = parser.parse_args(argv)
    logging.getLogger("servelab.scheduler").setLevel(logging.ERROR)  # preemption warnings are expected here
    out = args.out or default_run_dir("outputs/showcase")
    result = args.result or out / "showcase.md"
    plots = not args.no_plots
    run_one = lambda overrides, path, label: run(config([*overrides, f"plots={plots}"]), path, label)
    every = {"1": lambda: paged_vs_contiguous(out, plots), "2": lambda: fcfs_vs_priority(out, plots),
             "3": lambda: swap_vs_recompute(out, plots), "4": lambda: length_aware(run_one, out),
             "5": lambda: fair_share(run_one, out)}
    chosen = [k.strip() for k in args.sections.split(",") if k.strip()]
    bad = [k for k in chosen if k not in every]
    if bad or not chosen:
        raise ValueError(f"--sections={args.sections!r} is invalid: choose from {sorted(every)}")
    sections: list[Any] = [every[k]() for k in chosen]
    text = ("## Showcase (simulator, roofline model: qwen3-0.6b on one H200, `python -m experiments.showcase`)\n\n"
            + "\n".join(sections))
    write_output(result, text, "--result")
    print(text)
    print(f"written to {result}; runs in {out}")
    return text


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
