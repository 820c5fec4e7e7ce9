"""Timing one decode problem over kernel configs beside SDPA, shared by the decode sweeps
(bench_kernels_sweep, bench_kernels_sweep_tma) and the read-rate probe: Qwen3-0.6B attention
(16 query heads, 8 KV heads, head_dim 128, block_size 16, bf16), CUDA graphs rotating over enough
copies of the problem that every call reads from DRAM."""

import torch
import torch.nn.functional as F

from experiments.lib.kernel_cases import decode_problem
from experiments.lib.kernel_timing import copies_for, graph_ms
from kernels.decode import DecodeConfig, paged_decode_attention
from kernels.decode_packed import PackedDecodeConfig as P
from kernels.decode_tma import TmaDecodeConfig
from kernels.inputs import random_paged_problem

HQ, HKV, D, BS = 16, 8, 128, 16
PER_HEAD = [DecodeConfig(), DecodeConfig(num_stages=3)]


def name(cfg) -> str:
    if isinstance(cfg, TmaDecodeConfig):
        split = "" if cfg.num_splits is None else f"sp{cfg.num_splits}"
        lead = "" if cfg.lead is None else f"l{cfg.lead}"
        return f"tma-t{cfg.tile_tokens}b{cfg.num_bufs}{lead}w{cfg.num_warps}{split}"
    if isinstance(cfg, DecodeConfig):
        split = "" if cfg.num_splits is None else f"sp{cfg.num_splits}"
        warps = "" if cfg.num_warps == 4 else f"w{cfg.num_warps}"
        return f"head-n{cfg.block_n}s{cfg.num_stages}{warps}{split}"
    io = ("tma" if cfg.use_tma else "ptr") + ("" if cfg.pdl else "-nopdl")
    split = "" if cfg.min_split_tokens == P().min_split_tokens else f"-min{cfg.min_split_tokens}"
    return f"packed-n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}pp{cfg.programs_per_sm}-{io}{split}"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sequential_tables(prob) -> None:
    """Renumber the blocks so that each sequence's blocks are consecutive in the pool."""
    batch, width = prob.block_tables.shape
    nblk = (int(prob.context_lens.max()) + BS - 1) // BS
    tables = torch.arange(batch * nblk, device=prob.block_tables.device, dtype=torch.int32).view(batch, nblk)
    prob.block_tables = torch.cat([tables, prob.block_tables[:, nblk:]], 1) if width > nblk else tables


def time_point(label, sets, nbytes, copy_bw, configs, sdpa=True, expected=None) -> list[dict]:
    rows = []

    def add(variant, ms, err=None, note=""):
        row = {"shape": label, "variant": variant, "time_us": ms * 1e3, "GBps": nbytes / ms / 1e6,
               "frac_copy": nbytes / ms / 1e6 / copy_bw, "err": err, "note": note}  # fmt: skip
        rows.append(row)
        print(f"  {label:<24}{variant:<36}{row['time_us']:>9.1f} us {row['frac_copy']:.3f} of copy  err={err}",
              flush=True)  # fmt: skip

    if sdpa:
        fn = lambda s: F.scaled_dot_product_attention(s[0].q.unsqueeze(2), s[1], s[2], scale=s[0].scale,
                                                     enable_gqa=True)  # fmt: skip
        add("sdpa", graph_ms([lambda s=s: fn(s) for s in sets]))
        expected = fn(sets[0]).squeeze(2)
    for cfg in configs:
        try:
            out = paged_decode_attention(*sets[0][0].decode_args(), config=cfg)
            err = rel_err(out, expected) if expected is not None else None
            ms = graph_ms(
                [lambda s=s, c=cfg: paged_decode_attention(*s[0].decode_args(), config=c) for s in sets]
            )
            add(name(cfg), ms, err)
        except Exception as exc:  # noqa: BLE001
            rows.append(
                {"shape": label, "variant": name(cfg), "note": f"{type(exc).__name__}: {str(exc)[:300]}"}
            )
            print(f"  {label:<16}{name(cfg):<36} ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return rows


def uniform(batch: int, ctx: int, copy_bw: float, configs, sequential: bool = False) -> list[dict]:
    kv = 2 * batch * ctx * HKV * D * 2
    sets = [decode_problem(batch, ctx, HQ, HKV, D, BS, seed=i) for i in range(copies_for(kv))]
    label = f"B{batch}xL{ctx}"
    rows = time_point(label, sets, kv + 2 * batch * HQ * D * 2, copy_bw, configs)
    if sequential:
        for s in sets:
            sequential_tables(s[0])
        rows += time_point(label + "-seqtab", sets, kv + 2 * batch * HQ * D * 2, copy_bw, configs, sdpa=False)
    del sets
    torch.cuda.empty_cache()
    return rows


def ragged(copy_bw: float, configs) -> list[dict]:
    lens = torch.randint(100, 2001, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = 2 * sum(lens) * HKV * D * 2
    sets = [(random_paged_problem(lens, None, HQ, HKV, D, BS, torch.bfloat16, device="cuda", seed=i),)
            for i in range(copies_for(kv))]  # fmt: skip
    expected = paged_decode_attention(*sets[0][0].decode_args(), config=DecodeConfig())
    return time_point("B256x100..2000", sets, kv + 2 * 256 * HQ * D * 2, copy_bw, configs, sdpa=False,
                      expected=expected)  # fmt: skip
