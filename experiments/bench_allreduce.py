"""`python -m experiments.bench_allreduce`: all-reduce latency by message size on 2 (and 4) GPUs, the
engine's three paths in one run: NCCL, one-shot and two-shot over torch's symmetric memory
(engine/distributed/custom_all_reduce.py), each eager and replayed from a CUDA graph.

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
import os
import traceback
from pathlib import Path

import torch

from engine.config import ParallelConfig
from engine.distributed.custom_all_reduce import NCCL, ONE_SHOT, TWO_SHOT
from experiments.lib.paths import REPO_ROOT
from experiments.lib.profiling.collectives import all_reduce_call, mean_call_s, run_ranks

PATHS = (NCCL, ONE_SHOT, TWO_SHOT)
OUT = REPO_ROOT / "experiments" / "results" / "allreduce"
COLUMNS = ["world_size", "bytes", "mode", *(f"{p}_us" for p in PATHS), "one-shot_max_err", "two-shot_max_err"]


def _sizes(lo: int, hi: int) -> list[int]:
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= 2
    return sizes


def _time(group, path: str, nbytes: int, iters: int, graph: bool, replays: int) -> float:
    """Mean microseconds per bf16 all-reduce of `nbytes` on `path`: back to back, or `iters` calls
    captured in one graph."""
    call = all_reduce_call(group, path, nbytes // 2, torch.bfloat16, torch.device("cuda", group.rank))
    return mean_call_s(call, iters, "graph" if graph else "eager", replays) * 1e6


def _errors(group, nbytes: int) -> dict[str, float]:
    """Each symmetric path's largest difference from NCCL's sum of the same rank-seeded inputs."""
    import torch.distributed as dist

    gen = torch.Generator(device="cuda").manual_seed(1234 + group.rank)
    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda", generator=gen)
    expected = x.clone()
    dist.all_reduce(expected, group=group.device_group)
    out = {}
    for path in (ONE_SHOT, TWO_SHOT):
        staged = group.custom.buffer[:nbytes].view(torch.bfloat16)
        staged.copy_(x)
        out[path] = float((group.custom.reduce(path, staged).float() - expected.float()).abs().max())
    return out


def _rank_main(rank: int, size: int, port: int, a: argparse.Namespace, results) -> None:
    from engine.distributed.parallel_state import end_group, init_group, join_store

    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        parallel = ParallelConfig(size, disable_custom_all_reduce=False, custom_all_reduce_max_bytes=a.max_bytes)
        group = init_group(join_store(port, size, a.timeout_s), rank, size, device, a.timeout_s, parallel)
        if group.custom is None:
            raise RuntimeError("the symmetric-memory all-reduce is off (rank 0's log says why): nothing to compare")
        rows = []
        for nbytes in _sizes(a.min_bytes, a.max_bytes):
            iters = max(4, min(a.iters, a.graph_bytes // nbytes))
            errors = _errors(group, nbytes)
            for mode in ("eager", "graph"):
                row = {"world_size": size, "bytes": nbytes, "mode": mode,
                       "one-shot_max_err": errors[ONE_SHOT], "two-shot_max_err": errors[TWO_SHOT]}
                for path in PATHS:
                    row[f"{path}_us"] = _time(group, path, nbytes, iters, mode == "graph", a.replays)
                rows.append(row)
        torch.cuda.synchronize()
        if rank == 0:
            results.put(("ok", rows))
        group.custom = None
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
    print(f"\n{size} GPUs ({torch.cuda.get_device_name(0)}), microseconds per all-reduce of bf16; "
          "err: largest |symmetric - NCCL|")
    print(f"{'bytes':>10} {'mode':>6} {'nccl':>9} {'one-shot':>9} {'two-shot':>9} {'best':>9} {'err 1/2':>14}")
    for r in rows:
        times = {p: r[f"{p}_us"] for p in PATHS}
        best = min(times, key=times.get)
        print(f"{r['bytes']:>10,} {r['mode']:>6} {times[NCCL]:>9.1f} {times[ONE_SHOT]:>9.1f} {times[TWO_SHOT]:>9.1f} "
              f"{best:>9} {r['one-shot_max_err']:>6.3g}/{r['two-shot_max_err']:<6.3g}")
    one_shot_max, symmetric_max = thresholds(rows)
    print(f"graph timings support: parallel.custom_all_reduce_one_shot_max_bytes={one_shot_max} "
          f"parallel.custom_all_reduce_max_bytes={symmetric_max}  (wrote {path})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", default=None, help="e.g. 2,4 (default: 2, and 4 when 4 GPUs are here)")
    ap.add_argument("--min-bytes", type=int, default=1024)
    ap.add_argument("--max-bytes", type=int, default=64 * 2**20, help="also the symmetric buffer's size")
    ap.add_argument("--iters", type=int, default=50, help="all-reduces per timing (per graph when captured)")
    ap.add_argument("--graph-bytes", type=int, default=2**30, help="fewer calls per graph above this many bytes")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=240.0, help="deadline of each world size's run")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    gpus = torch.cuda.device_count()
    sizes = [int(s) for s in a.world_sizes.split(",")] if a.world_sizes else [s for s in (2, 4) if s <= gpus]
    if not sizes or max(sizes) > gpus:
        ap.error(f"--world-sizes {sizes} is invalid: this machine has {gpus} GPUs (at least 2 needed)")
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
