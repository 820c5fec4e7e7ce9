"""`python -m experiments.bench_allreduce`: all-reduce latency by message size on 2 (and 4) GPUs, the
engine's paths in one run: NCCL, one-shot and two-shot over torch's symmetric memory
(engine/distributed/symmetric_all_reduce.py), the same two in Triton over the same buffer
(kernels/all_reduce.py, `parallel.all_reduce_kernel=triton`), the Triton all-reduce fused with
the residual add and RMSNorm (`triton_fused`; rows of --hidden bf16, sizes that hold whole rows),
and the barrier-free one-shot (kernels/all_reduce_lamport.py, `triton_lamport`), plain and fused,
each eager and replayed from a CUDA graph. The group opens with `triton_lamport`, whose symmetric
allocation holds one region for the barrier kernels (torch's and Triton's share it) and the
Lamport kernel's rounds; each timed sequence of Lamport calls starts as a forward does (round 0).

Each world size runs in its own processes (one per GPU, spawned, bounded by --timeout-s), through
the engine's own group set-up (`init_group`) and the engine's own calls: NCCL sums a tensor in
place, the symmetric paths sum a bf16 message already in the symmetric buffer (where the engine's
row-parallel GEMMs write it) into a new tensor. Per size and mode: the mean microseconds per
all-reduce over back-to-back calls (CUDA events), and the largest difference of each symmetric
result from NCCL's. Prints a table per world size, writes `allreduce-tp<N>.csv` under --out, and
the thresholds the graph timings support (what `parallel.custom_all_reduce_one_shot_max_bytes` /
`custom_all_reduce_max_bytes` should be: decode steps replay graphs).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import traceback
from pathlib import Path

import torch

from engine.distributed.all_reduce_path import NCCL, ONE_SHOT, TWO_SHOT
from engine.distributed.symmetric_all_reduce import SymmetricAllReduce
from engine.parallel_config import ParallelConfig
from experiments.lib.paths import REPO_ROOT
from experiments.lib.profiling.collective_calls import all_reduce_call, mean_call_s, torch_kernels
from experiments.lib.profiling.collectives import run_ranks

TRITON_ONE_SHOT, TRITON_TWO_SHOT, TRITON_FUSED = "triton-one-shot", "triton-two-shot", "triton-fused"
LAMPORT, LAMPORT_FUSED = "triton-lamport", "lamport-fused"
SUMS = (NCCL, ONE_SHOT, TWO_SHOT, TRITON_ONE_SHOT, TRITON_TWO_SHOT, LAMPORT)  # plain all-reduces
PATHS = (*SUMS, TRITON_FUSED, LAMPORT_FUSED)
FUSED = (TRITON_FUSED, LAMPORT_FUSED)
CHECKED = PATHS[1:]  # each compared with NCCL's sum (the fused ones with NCCL's sum, then add_rms_norm)
TRITON_PATH = {TRITON_ONE_SHOT: ONE_SHOT, TRITON_TWO_SHOT: TWO_SHOT}
OUT = REPO_ROOT / "experiments" / "results" / "allreduce"
COLUMNS = ["world_size", "bytes", "mode", *(f"{p}_us" for p in PATHS), *(f"{p}_max_err" for p in CHECKED)]
EPS = 1e-6


def _sizes(lo: int, hi: int) -> list[int]:
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= 2
    return sizes


def _fused_inputs(triton, nbytes: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...] | None:
    """(staged rows, residual, weight) for the fused kernel, or None if `nbytes` is not whole rows."""
    if nbytes % (2 * hidden):
        return None
    rows = nbytes // (2 * hidden)
    gen = torch.Generator(device="cuda").manual_seed(seed)  # the same on every rank, as the residual stream
    residual = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda", generator=gen)
    weight = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    return triton.buffer[:nbytes].view(torch.bfloat16).view(rows, hidden), residual, weight


def _time(group, triton, path: str, nbytes: int, a: argparse.Namespace, graph: bool) -> float:
    """Mean microseconds per bf16 all-reduce of `nbytes` on `path`: back to back, or `iters` calls
    captured in one graph (NaN where the path does not take the size)."""
    iters = max(4, min(a.iters, a.graph_bytes // nbytes))
    lamport, begin = group.custom, None
    if path in TRITON_PATH or path in FUSED or path == LAMPORT:
        staged = triton.buffer[:nbytes].view(torch.bfloat16)
        staged.normal_()
        if path in FUSED:
            fused = _fused_inputs(triton, nbytes, a.hidden, seed=1)
            if fused is None:
                return float("nan")
            kernels = triton if path == TRITON_FUSED else lamport
            call = (lambda: kernels.all_reduce_add_rms_norm(*fused, EPS))
        elif path == LAMPORT:
            call = (lambda: lamport.all_reduce(staged))  # it reads its input wherever it is
        else:
            call = (lambda: triton.reduce(TRITON_PATH[path], staged))
        begin = lamport.begin_forward if path in (LAMPORT, LAMPORT_FUSED) else None
    else:
        call = all_reduce_call(group, path, nbytes // 2, torch.bfloat16, torch.device("cuda", group.rank))
    return mean_call_s(call, iters, "graph" if graph else "eager", a.replays, begin=begin) * 1e6


def _errors(group, triton, nbytes: int, hidden: int) -> dict[str, float]:
    """Each symmetric path's largest difference from NCCL's sum of the same rank-seeded inputs (the
    fused one's from NCCL's sum then engine/models/ops.py's add_rms_norm; NaN: not whole rows)."""
    import torch.distributed as dist

    from engine.models.ops import add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(1234 + group.rank)
    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda", generator=gen)
    expected = x.clone()
    dist.all_reduce(expected, group=group.device_group)
    out = {}
    lamport = group.custom
    for path in (ONE_SHOT, TWO_SHOT, TRITON_ONE_SHOT, TRITON_TWO_SHOT):
        custom = triton if path in TRITON_PATH else torch_kernels(lamport)
        staged = custom.buffer[:nbytes].view(torch.bfloat16)
        staged.copy_(x)
        out[path] = float((custom.reduce(TRITON_PATH.get(path, path), staged).float() - expected.float()).abs().max())
    out[LAMPORT] = float((lamport.all_reduce(x).float() - expected.float()).abs().max())
    fused = _fused_inputs(triton, nbytes, hidden, seed=2)
    for path, kernels in ((TRITON_FUSED, triton), (LAMPORT_FUSED, lamport)):
        out[path] = float("nan")
        if fused is not None:
            staged, residual, weight = fused
            staged.copy_(x.view(staged.shape))
            want = add_rms_norm(expected.view(staged.shape), residual, weight, EPS)[0]
            got = kernels.all_reduce_add_rms_norm(staged, residual, weight, EPS)[0]
            out[path] = float((got.float() - want.float()).abs().max())
    return out


def _triton_beside(group) -> SymmetricAllReduce:
    """The Triton barrier kernels over the group's barrier region, one region with closing
    barriers (the group's own kernels are the Lamport ones; torch's share the region)."""
    from kernels.all_reduce import PeerBuffers

    custom = group.custom
    peers = PeerBuffers.of_rendezvous(custom.handle, custom.buffer)
    peers = dataclasses.replace(peers, max_programs=group.min_int(peers.max_programs))  # the same grids everywhere
    return SymmetricAllReduce(custom.buffer, custom.group_name, custom.one_shot_max, custom.two_shot_max,
                              custom.handle, peers=peers, fused=True)


def _rank_main(rank: int, size: int, port: int, a: argparse.Namespace, results) -> None:
    from engine.distributed.parallel_state import end_group, init_group, join_store

    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        parallel = ParallelConfig(size, disable_custom_all_reduce=False, custom_all_reduce_max_bytes=a.max_bytes,
                                  all_reduce_kernel="triton_lamport")
        group = init_group(join_store(port, size, a.timeout_s), rank, size, device, a.timeout_s, parallel)
        if group.custom is None:
            raise RuntimeError("the symmetric-memory all-reduce is off (rank 0's log says why): nothing to compare")
        triton = _triton_beside(group)
        rows = []
        for nbytes in _sizes(a.min_bytes, a.max_bytes):
            errors = _errors(group, triton, nbytes, a.hidden)
            for mode in ("eager", "graph"):
                row = {"world_size": size, "bytes": nbytes, "mode": mode,
                       **{f"{p}_max_err": errors[p] for p in CHECKED}}
                for path in PATHS:
                    row[f"{path}_us"] = _time(group, triton, path, nbytes, a, mode == "graph")
                rows.append(row)
        torch.cuda.synchronize()
        if rank == 0:
            results.put(("ok", rows))
        group.custom = triton = None
        end_group(4.0, 2.0)
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which prints it)
        results.put(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))


def run_world(size: int, a: argparse.Namespace) -> list[dict] | str:
    """The rows of one world size, or why there are none (an error, or the deadline)."""
    status, payload = run_ranks(_rank_main, size, (a,), a.timeout_s)
    return payload if status == "ok" else str(payload)


def thresholds(rows: list[dict]) -> tuple[int, int]:
    """(one-shot max, symmetric max) that the graph timings support: the symmetric paths up to the
    last size of the run of sizes, from the smallest, where the faster of them beats NCCL;
    one-shot up to the last size before two-shot first beats it."""
    graph = sorted((r for r in rows if r["mode"] == "graph"), key=lambda r: r["bytes"])
    symmetric_max = one_shot_max = 0
    one_shot_open = True
    for r in graph:
        if min(r["one-shot_us"], r["two-shot_us"]) >= r["nccl_us"]:
            break
        symmetric_max = r["bytes"]
        one_shot_open = one_shot_open and r["one-shot_us"] <= r["two-shot_us"]
        if one_shot_open:
            one_shot_max = r["bytes"]
    return one_shot_max, symmetric_max


def report(size: int, rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"allreduce-tp{size}.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(f"\n{size} GPUs ({torch.cuda.get_device_name(0)}), microseconds per all-reduce of bf16 (torch: torch's "
          "symmetric-memory kernels; tri: Triton's; lamport: the barrier-free one-shot; fused / lam-fus: "
          "the Triton / Lamport all-reduce + residual add + RMSNorm); "
          "err: largest |path - NCCL| (the fused ones' after the norm), in the paths' order")
    heads = ("nccl", "torch-1", "torch-2", "tri-1", "tri-2", "lamport", "fused", "lam-fus")
    print(f"{'bytes':>10} {'mode':>6} " + " ".join(f"{h:>8}" for h in heads) + f" {'best sum':>16}  err")
    for r in rows:
        times = {p: r[f"{p}_us"] for p in PATHS}
        best = min(SUMS, key=times.get)  # the plain sums (the fused kernels also norm)
        errs = "/".join(f"{r[f'{p}_max_err']:.2g}" for p in CHECKED)
        print(f"{r['bytes']:>10,} {r['mode']:>6} " + " ".join(f"{times[p]:>8.1f}" for p in PATHS) +
              f" {best:>16}  {errs}")
    for kernel, (one, two) in (("torch", (ONE_SHOT, TWO_SHOT)), ("triton", (TRITON_ONE_SHOT, TRITON_TWO_SHOT))):
        as_torch = [{**r, "one-shot_us": r[f"{one}_us"], "two-shot_us": r[f"{two}_us"]} for r in rows]
        one_shot_max, symmetric_max = thresholds(as_torch)
        print(f"graph timings support, parallel.all_reduce_kernel={kernel}: "
              f"parallel.custom_all_reduce_one_shot_max_bytes={one_shot_max} "
              f"parallel.custom_all_reduce_max_bytes={symmetric_max}")
    print(f"(wrote {path})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", default=None, help="e.g. 2,4 (default: 2, and 4 when 4 GPUs are here)")
    ap.add_argument("--min-bytes", type=int, default=1024)
    ap.add_argument("--max-bytes", type=int, default=64 * 2**20, help="also the symmetric buffer's size")
    ap.add_argument("--iters", type=int, default=50, help="all-reduces per timing (per graph when captured)")
    ap.add_argument("--graph-bytes", type=int, default=2**30, help="fewer calls per graph above this many bytes")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=4096, help="row width of the fused kernel's messages (bf16)")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="deadline of each world size's run")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    gpus = torch.cuda.device_count()
    sizes = [int(s) for s in a.world_sizes.split(",")] if a.world_sizes else [s for s in (2, 4) if s <= gpus]
    if not sizes or max(sizes) > gpus:
        ap.error(f"--world-sizes {sizes} is invalid: each must be >= 2 and at most the GPUs this machine has ({gpus})")
    if a.min_bytes < 16 or a.min_bytes % 16 or a.max_bytes < a.min_bytes:
        ap.error(f"--min-bytes {a.min_bytes} / --max-bytes {a.max_bytes} are invalid: multiples of 16, min <= max")
    ParallelConfig(custom_all_reduce_max_bytes=a.max_bytes)  # a ValueError naming a bad --max-bytes
    failed = False
    for size in sizes:
        outcome = run_world(size, a)
        if isinstance(outcome, str):
            print(f"\n{size} GPUs: no result: {outcome}", flush=True)
            failed = True
        else:
            report(size, outcome, a.out)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
