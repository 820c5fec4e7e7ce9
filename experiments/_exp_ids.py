"""One-off (round 16): page ids loaded 1 or 4 steps ahead; loads with and without table loads; SDPA beside."""
import torch
import torch.nn.functional as F

from experiments.bench_kernels_cases import decode_problem
from experiments.bench_timing import copies_for, graph_ms
from kernels.decode_tma import TmaDecodeConfig, paged_decode_tma
from kernels.inputs import random_paged_problem

HQ, HKV, D, BS = 16, 8, 128, 16

# correctness: ahead 4 == ahead 1 bitwise, ragged with short sequences, 1/3 splits, tiles 16/32/64
lens = torch.randint(1, 3000, (40,), generator=torch.Generator().manual_seed(1)).tolist() + [1, 16, 17, 33, 48, 64, 65, 100]
prob = random_paged_problem(lens, None, HQ, HKV, D, BS, torch.bfloat16, device="cuda", seed=1)
for cfg in (TmaDecodeConfig(), TmaDecodeConfig(tile_tokens=16, num_bufs=3, lead=2), TmaDecodeConfig(tile_tokens=64)):
    for splits in (1, 3):
        outs = []
        for ahead in (1, 4):
            out = torch.full_like(prob.q, float("nan"))
            B = prob.q.shape[0]
            po = torch.full((B * HQ * splits, D), float("nan"), device="cuda")
            pl = torch.full((B * HQ * splits,), float("nan"), device="cuda")
            paged_decode_tma(*prob.decode_args(), out, po, pl, splits, cfg, ahead=ahead)
            outs.append(out if splits == 1 else torch.cat([po.flatten(), pl]))
        print("equal", cfg.tile_tokens, splits, torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0)), flush=True)


def run(batch):
    kv = 2 * batch * 4096 * HKV * D * 2
    sets = [decode_problem(batch, 4096, HQ, HKV, D, BS, seed=i) for i in range(copies_for(kv))]
    out = torch.empty_like(sets[0][0].q)
    sdpa = lambda s: F.scaled_dot_product_attention(s[0].q.unsqueeze(2), s[1], s[2], scale=s[0].scale, enable_gqa=True)
    print(f"B{batch} sdpa {graph_ms([lambda s=s: sdpa(s) for s in sets]) * 1e3:.1f}", flush=True)
    cfg = TmaDecodeConfig(num_splits=1)
    for math, arith, ahead in ((True, False, 1), (True, False, 4), (False, False, 1), (False, False, 4), (False, True, 1), (True, False, 1), (True, False, 4)):
        fns = [lambda s=s: paged_decode_tma(*s[0].decode_args(), out, out, out, 1, cfg, math=math, arith=arith, ahead=ahead) for s in sets]
        print(f"B{batch} math={math} arith={arith} ahead={ahead} {graph_ms(fns) * 1e3:.1f}", flush=True)
    print(f"B{batch} sdpa {graph_ms([lambda s=s: sdpa(s) for s in sets]) * 1e3:.1f}", flush=True)


for batch in (64, 64):
    run(batch)
