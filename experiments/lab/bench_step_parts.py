"""`python -m experiments.lab.bench_step_parts [--out DIR]`: the decode step's tunable parts at engine
shapes, each variant timed from CUDA-graph replays (experiments/lib/kernel_timing.py).

- Gluon TMA decode + split merge on ragged batches like the nano-vllm benchmark's (Qwen3-0.6B
  attention, contexts uniform in 100..1900, launched longest first, block tables as wide as the
  engine's at max_model_len 4096), for the split-count heuristic and fixed split counts;
- the split merge kernel alone at num_warps 1, 2, 4;
- the Gumbel sampler over [rows, 151936] bf16 logits for chunk / block / num_warps variants.
Prints the table and writes it as CSV to --out (default outputs/bench_step_parts/).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
import triton

from experiments.lib.kernel_cases import ragged_decode_problem
from experiments.lib.kernel_timing import graph_ms, run_stamp
from kernels.decode import paged_decode_attention
from kernels.decode_splits import decode_reduce_kernel
from kernels.decode_tma import TmaDecodeConfig
from kernels.sample import _chunk_best_kernel, _row_best_kernel

HQ, HKV, D, BS, WIDTH, VOCAB = 16, 8, 128, 16, 256, 151936


def decode_rows(batches: list[int], copy_bw: float) -> list[dict]:
    rows = []
    for batch in batches:
        prob = ragged_decode_problem(batch, 100, 1900, HQ, HKV, D, BS)
        tables = torch.zeros(batch, WIDTH, dtype=torch.int32, device="cuda")
        tables[:, :prob.block_tables.shape[1]] = prob.block_tables
        order = torch.argsort(prob.context_lens, descending=True).to(torch.int32)
        out = torch.empty_like(prob.q)
        nbytes = int(prob.context_lens.sum()) * HKV * D * 2 * 2
        for splits in (None, 1, 2, 4, 8):
            cfg = TmaDecodeConfig(num_splits=splits)

            def fn(cfg=cfg, prob=prob, tables=tables, out=out, order=order):
                paged_decode_attention(prob.q, prob.k_cache, prob.v_cache, tables, prob.context_lens, D ** -0.5,
                                       config=cfg, out=out, order=order)
            ms = graph_ms([fn])
            rows.append({"part": "tma decode + merge", "shape": f"{batch} x U[100,1900]",
                         "variant": f"splits={splits or 'heuristic'}", "us": round(ms * 1e3, 1),
                         "TB_s": round(nbytes / ms / 1e9, 2), "of_copy": round(nbytes / ms / 1e9 / copy_bw, 3)})
    return rows


def merge_rows(batch: int, splits: int) -> list[dict]:
    rows = []
    part_out = torch.randn(batch * HQ * splits, D, device="cuda")
    part_lse = torch.randn(batch * HQ * splits, device="cuda")
    out = torch.empty(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    for warps in (1, 2, 4):
        def fn(warps=warps):
            decode_reduce_kernel[(batch, HQ)](part_out, part_lse, out, out.stride(0), out.stride(1), NUM_HEADS=HQ,
                                              HEAD_DIM=D, BLOCK_D=D, NUM_SPLITS=splits,
                                              BLOCK_S=triton.next_power_of_2(splits), num_warps=warps)
        rows.append({"part": "split merge", "shape": f"{batch} x {HQ} heads x {splits} splits",
                     "variant": f"num_warps={warps}", "us": round(graph_ms([fn]) * 1e3, 1)})
    return rows


def sampler_rows(batch: int) -> list[dict]:
    rows = []
    logits = torch.randn(batch, VOCAB, device="cuda").to(torch.bfloat16)
    temps = torch.full((batch,), 0.6, device="cuda")
    out = torch.empty(batch, dtype=torch.int64, device="cuda")
    for chunk, block, warps in ((8192, 1024, 4), (8192, 2048, 4), (8192, 2048, 8), (16384, 4096, 8), (4096, 1024, 4)):
        num_chunks = triton.cdiv(VOCAB, chunk)
        best_val = torch.empty(batch, num_chunks, device="cuda")
        best_idx = torch.empty(batch, num_chunks, dtype=torch.int32, device="cuda")

        def fn(chunk=chunk, block=block, warps=warps, num_chunks=num_chunks, best_val=best_val, best_idx=best_idx):
            _chunk_best_kernel[(batch, num_chunks)](logits, logits.stride(0), temps, best_val, best_idx, 1234, VOCAB,
                                                    num_chunks, CHUNK=chunk, BLOCK=block, num_warps=warps)
            _row_best_kernel[(batch,)](best_val, best_idx, out, num_chunks,
                                       BLOCK_C=triton.next_power_of_2(num_chunks))
        ms = graph_ms([fn])
        rows.append({"part": "gumbel sampler", "shape": f"{batch} x {VOCAB} bf16",
                     "variant": f"chunk={chunk} block={block} warps={warps}", "us": round(ms * 1e3, 1),
                     "TB_s": round(batch * VOCAB * 2 / ms / 1e9, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,128,176,256")
    ap.add_argument("--out", type=Path, default=Path("outputs/bench_step_parts"))
    a = ap.parse_args()
    from experiments.lib.engine_bench import copy_bandwidth
    copy_bw = copy_bandwidth(torch.device("cuda")) / 1e12
    batches = [int(b) for b in a.batches.split(",") if b]
    rows = (decode_rows(batches, copy_bw) if batches else []) + merge_rows(176, 4) + sampler_rows(176)
    table = pd.DataFrame(rows)
    print(f"copy bandwidth {copy_bw:.2f} TB/s")
    print(table.to_string(index=False))
    stamp = run_stamp()
    a.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(stamp.csv(str(a.out), "bench_step_parts"), index=False)


if __name__ == "__main__":
    main()
