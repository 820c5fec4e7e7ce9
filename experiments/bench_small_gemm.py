"""Benchmark of the split-K GEMM (kernels/small_gemm.py) against cuBLAS (`torch.mm`) on a CUDA GPU:
`python -m experiments.bench_small_gemm [--out DIR] [--no-sweep]`.

Shapes: the decode-step GEMMs with few output columns: Qwen3-0.6B o_proj (N 1,024, K 2,048) and
down_proj (1,024 x 3,072); Qwen3-8B o_proj and down_proj at TP=1 (4,096 x 4,096, 4,096 x 12,288)
and one rank's at TP=2 (4,096 x 2,048, 4,096 x 6,144); M (the decode batch) 64, 128, 176, 256, 512.
bf16, no bias. Each product is timed from CUDA-graph replays (experiments/lib/kernel_timing.py)
rotating over copies of the weight so that every call reads it from DRAM, as a step's layers do;
the activation is one tensor (in L2, as the previous kernel's output is in the engine). TB/s counts
the weight's bytes. `splitk` runs the engine's config (`pick_config`); where the engine keeps cuBLAS
(`engine` column "torch": output tiles enough to fill the SMs) it runs that tile with two splits.
The sweep times a handful of tile / split variants at Qwen3-0.6B's shapes and the engine's common
batches, and names the fastest, to check or retune `kernels.small_gemm.TILES`. Every variant is
checked against torch.mm before it is timed. Writes a CSV named by device and date to --out
(default outputs/bench_small_gemm/). About 40 s on an H200.
"""
from __future__ import annotations

import argparse
import time

import torch

from experiments.lib.kernel_timing import copies_for, copy_gbps, graph_ms, run_stamp
from kernels.small_gemm import SplitKConfig, new_counters, pick_config, splitk_linear

SHAPES = [("qwen3-0.6b o_proj", 1024, 2048), ("qwen3-0.6b down", 1024, 3072),
          ("qwen3-8b o_proj tp1", 4096, 4096), ("qwen3-8b down tp1", 4096, 12288),
          ("qwen3-8b o_proj tp2", 4096, 2048), ("qwen3-8b down tp2", 4096, 6144)]
BATCHES = (64, 128, 176, 256, 512)
SWEEP_SHAPES = SHAPES[:2]
SWEEP_BATCHES = (128, 176, 256)
SWEEP_TILES = [SplitKConfig(64, 64, 128, num_stages=3), SplitKConfig(64, 64, 128, num_stages=4),
               SplitKConfig(64, 128, 64, num_warps=8, num_stages=4), SplitKConfig(128, 64, 64, num_warps=8, num_stages=4),
               SplitKConfig(64, 32, 128, num_stages=4), SplitKConfig(32, 64, 128, num_stages=3)]
SWEEP_SPLITS = (1, 2, 4, 8)
TIMING_MS = 3.0  # per graph replay: many calls, short enough to keep the run under a minute


def _label(cfg: SplitKConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.splits} w{cfg.num_warps} st{cfg.num_stages}"


class Problem:
    """x [m, k] and enough copies of a bf16 weight [n, k] that a graph's calls read it from DRAM."""

    def __init__(self, m: int, n: int, k: int) -> None:
        self.m, self.n, self.k = m, n, k
        self.x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        self.weights = [(torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
                        for _ in range(copies_for(n * k * 2))]
        self.out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        self.counters = new_counters(n, "cuda")
        self.want = torch.mm(self.x, self.weights[0].t()).float()

    def time_us(self, config: SplitKConfig | None) -> float:
        """One product's time from graph replays: cuBLAS's (config None) or the split kernel's."""
        if config is None:
            fns = [lambda w=w: torch.mm(self.x, w.t(), out=self.out) for w in self.weights]
        else:
            got = splitk_linear(self.x, self.weights[0], None, self.counters, config).float()
            err = ((got - self.want).norm() / self.want.norm()).item()
            if err > 1e-2:
                raise AssertionError(f"{_label(config)} at {self.m}x{self.n}x{self.k}: relative error {err:.3g}")
            fns = [lambda w=w: splitk_linear(self.x, w, None, self.counters, config, out=self.out)
                   for w in self.weights]
        return graph_ms(fns, target_ms=TIMING_MS) * 1e3

    def tb_s(self, us: float) -> float:
        return self.n * self.k * 2 / us / 1e6


def main_rows(sms: int, save) -> None:
    for name, n, k in SHAPES:
        for m in BATCHES:
            prob = Problem(m, n, k)
            engine = pick_config(m, n, k, sms)
            config = engine or pick_config(m, 64, k, sms).with_splits(k, 2)
            torch_us, split_us = prob.time_us(None), prob.time_us(config)
            row = {"kind": "engine shape", "shape": name, "n": n, "k": k, "m": m,
                   "engine": "splitk" if engine else "torch", "config": _label(config),
                   "torch_us": round(torch_us, 2), "splitk_us": round(split_us, 2),
                   "speedup": round(torch_us / split_us, 3), "torch_TB_s": round(prob.tb_s(torch_us), 2),
                   "splitk_TB_s": round(prob.tb_s(split_us), 2)}
            print(f"{name:22s} m={m:3d}  torch {torch_us:6.2f} us ({row['torch_TB_s']:.2f} TB/s)  "
                  f"splitk {split_us:6.2f} us ({row['splitk_TB_s']:.2f} TB/s)  x{row['speedup']:.2f}  "
                  f"[{row['config']}, engine runs {row['engine']}]", flush=True)
            save([row])


def sweep_rows(sms: int, save) -> None:
    for name, n, k in SWEEP_SHAPES:
        for m in SWEEP_BATCHES:
            prob = Problem(m, n, k)
            torch_us = prob.time_us(None)
            table = pick_config(m, n, k, sms)
            results = []
            for tile in SWEEP_TILES:
                for splits in sorted({tile.with_splits(k, s).splits for s in SWEEP_SPLITS}):
                    cfg = tile.with_splits(k, splits)
                    if cfg.tiles(m, n) * cfg.splits > 4 * sms:
                        continue
                    results.append((prob.time_us(cfg), cfg))
            best_us, best = min(results, key=lambda r: r[0])
            rows = [{"kind": "sweep", "shape": name, "n": n, "k": k, "m": m, "config": _label(cfg),
                     "engine": "splitk" if cfg == table else "", "torch_us": round(torch_us, 2),
                     "splitk_us": round(us, 2), "speedup": round(torch_us / us, 3),
                     "torch_TB_s": round(prob.tb_s(torch_us), 2), "splitk_TB_s": round(prob.tb_s(us), 2)}
                    for us, cfg in results]
            print(f"sweep {name:18s} m={m:3d}  torch {torch_us:6.2f} us  best {best_us:6.2f} us [{_label(best)}]  "
                  f"engine's [{_label(table)}]", flush=True)
            save(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_small_gemm", help="folder for the CSV")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile / split sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_small_gemm needs a CUDA GPU")
    stamp = run_stamp()
    start = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_bw = copy_gbps()
    print(f"{sms} SMs, copy {copy_bw:.0f} GB/s (read+write)")
    save = stamp.csv_writer(args.out, "bench_small_gemm", copy_GB_s=round(copy_bw))
    main_rows(sms, save)
    if not args.no_sweep:
        sweep_rows(sms, save)
    print(f"wrote {save([])} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
