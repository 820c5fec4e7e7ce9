"""Round 11 of kernels/NOTES.md: is the per-head decode kernel's math part of its gap to SDPA?
`python -m experiments.bench_decode_math [--out DIR]` (CUDA GPU).

With GQA 2 (Qwen3-0.6B) a KV head has 2 query heads, but `tl.dot` needs 16 rows: the kernel computes
scores, exp2 and the PV product for 16 rows of which 14 are padding, 8x the MUFU work needed. This
sweep times, at batch 64 x 4k, the production kernel's loop (`full`) against the same loop with the
exponentials replaced by a multiply (`noexp`, wrong results, timing only) and with both products done
on CUDA cores over the real rows only (`fma`: broadcast multiply and sum, exp2 on 2 x N), SDPA before
and after. A copy of the kernel's split-free path, so the production kernel stays as it is.
"""

import argparse
import datetime

import pandas as pd
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from experiments.bench_kernels_cases import decode_problem
from experiments.bench_timing import copies_for, copy_gbps, graph_ms
from kernels.common import LOG2E

HQ, HKV, D, BS = 16, 8, 128, 16


@triton.jit
def _kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale_log2, stride_qb, stride_kb, stride_kt,
            stride_kh, stride_bt, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_N: tl.constexpr, MATH: tl.constexpr):  # fmt: skip
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
    length = tl.load(lens_ptr + b)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    h_mask = (offs_h < GROUP)[:, None]
    q = tl.load(q_ptr + (b * stride_qb + heads[:, None] * D + offs_d[None, :]), mask=h_mask, other=0.0)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    table = tables_ptr + b * stride_bt
    k_base = k_ptr + kv_head * stride_kh + offs_d[None, :]
    v_base = v_ptr + kv_head * stride_kh + offs_d[None, :]
    page = tl.load(table + offs_n // BLOCK_SIZE, mask=offs_n < length, other=0).to(tl.int64)
    for tile in range(0, length, BLOCK_N):
        tokens = tile + offs_n
        n_mask = tokens < length
        rows = (page * stride_kb + (tokens % BLOCK_SIZE) * stride_kt)[:, None]
        k = tl.load(k_base + rows, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_base + rows, mask=n_mask[:, None], other=0.0)
        after = tokens + BLOCK_N
        page = tl.load(table + after // BLOCK_SIZE, mask=after < length, other=0).to(tl.int64)
        if MATH == "fma":
            qk = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        if MATH == "noexp":
            p = tl.where(n_mask[None, :], qk * scale_log2 - m_new[:, None], 0.0)
            alpha = m_i - m_new + 1.0
        else:
            p = tl.exp2(qk * scale_log2 - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MATH == "fma":
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (b * stride_qb + heads[:, None] * D + offs_d[None, :]), acc.to(out_ptr.dtype.element_ty),
             mask=h_mask)



def attend(prob, math: str, block_n: int, num_stages: int, num_warps: int = 4) -> torch.Tensor:
    q, k, v, tables, lens, scale = prob.decode_args()
    out = torch.empty_like(q)
    group = HQ // HKV
    block_h = triton.next_power_of_2(group) if math == "fma" else max(16, triton.next_power_of_2(group))
    _kernel[(HKV, q.shape[0])](q, k, v, tables, lens, out, scale * LOG2E, q.stride(0), k.stride(0), k.stride(1), k.stride(2),
                               tables.stride(0), GROUP=group, BLOCK_H=block_h, D=D, BLOCK_SIZE=BS, BLOCK_N=block_n,
                               MATH=math, num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    return out


VARIANTS = [(m, n, s, w) for m in ("full", "noexp", "fma") for n, s in ((32, 3), (32, 4)) for w in (4,)] + \
    [("fma", 16, 4, 4), ("fma", 64, 3, 4), ("fma", 32, 3, 8)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M")
    copy_bw = copy_gbps()
    print(f"{device} | torch {torch.__version__} | triton {triton.__version__} | {date} | copy {copy_bw:.0f} GB/s")
    batch, ctx = 64, 4096
    kv = 2 * batch * ctx * HKV * D * 2
    sets = [decode_problem(batch, ctx, HQ, HKV, D, BS, seed=i) for i in range(copies_for(kv))]
    sdpa = lambda s: F.scaled_dot_product_attention(s[0].q.unsqueeze(2), s[1], s[2], scale=s[0].scale,
                                                    enable_gqa=True)  # fmt: skip
    expected = sdpa(sets[0]).squeeze(2).float()
    rows = [{"variant": "sdpa", "time_us": graph_ms([lambda s=s: sdpa(s) for s in sets]) * 1e3}]
    print(f"  sdpa {rows[-1]['time_us']:.1f} us", flush=True)
    for math, n, st, w in VARIANTS:
        name = f"{math}-n{n}s{st}w{w}"
        try:
            err = ((attend(sets[0][0], math, n, st, w).float() - expected).norm() / expected.norm()).item()
            us = graph_ms([lambda s=s, a=(math, n, st, w): attend(s[0], *a) for s in sets]) * 1e3
            rows.append({"variant": name, "time_us": us, "err": err})
            print(f"  {name:<22}{us:9.1f} us  err={err:.2e}", flush=True)
        except Exception as exc:  # noqa: BLE001
            rows.append({"variant": name, "note": f"{type(exc).__name__}: {str(exc)[:200]}"})
            print(f"  {name:<22} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    rows.append({"variant": "sdpa-end", "time_us": graph_ms([lambda s=s: sdpa(s) for s in sets]) * 1e3})
    print(f"  sdpa (end) {rows[-1]['time_us']:.1f} us", flush=True)
    table = pd.DataFrame(rows)
    table.insert(0, "device", device)
    table.insert(1, "date", date)
    table.insert(2, "shape", f"B{batch}xL{ctx}")
    table.to_csv(f"{args.out}/bench_decode_math_{device.replace(' ', '_')}_{date.replace(':', '')}.csv", index=False)


if __name__ == "__main__":
    main()
