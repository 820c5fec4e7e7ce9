"""`python -m experiments.bench_tp_message`: what sending one step to a tensor-parallel worker costs
on the CPU (gloo, 2 processes), the engine's way against pickling the step's Python objects.

- packed (engine/distributed/step_message.py): a header of int64s down a pipe, then one broadcast
  of the step's packed input bytes (`engine.device.batch_layout`, decode rows with full-width block tables);
- pickled: `torch.distributed.broadcast_object_list` of per-sequence (token, position, block table)
  tuples, what a worker would need to rebuild the same inputs itself.
Prints the median microseconds per step for decode batches of a few sizes (rank 0's wall clock, a
barrier every step so the worker has received it; the barrier's own median, measured alone,
subtracted).
"""
from __future__ import annotations

import argparse
import multiprocessing
import time

import numpy as np
import torch
import torch.distributed as dist

from engine.device.batch_layout import BatchShape, layout
from engine.distributed.parallel_state import init_group, join_store, open_store
from engine.distributed.step_message import StepHeader

BATCHES = (1, 16, 64, 256)
WIDTH = 256  # block-table columns: max_model_len 4096 in blocks of 16
CONTEXT = 512  # tokens per sequence: 32 blocks each


def _steps(batch: int):
    shape = BatchShape(batch, batch, 0, batch, WIDTH)
    objects = [(7, CONTEXT, list(range(i * 32, (i + 1) * 32))) for i in range(batch)]
    return shape, objects


def _run(rank: int, store: dist.Store, conn, iters: int) -> dict[tuple[int, str], float]:
    """Median microseconds per step by (batch, method)."""
    torch.set_num_threads(1)
    group = init_group(store, rank, 2, torch.device("cpu"), 60)
    results = {}
    for batch in BATCHES:
        shape, objects = _steps(batch)
        buf = torch.zeros(layout(shape)[1], dtype=torch.uint8)
        header = StepHeader(shape).encode()
        for method in ("barrier", "packed", "pickled"):
            dist.barrier()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                if method == "barrier":
                    pass
                elif method == "packed":
                    if rank == 0:
                        conn.send_bytes(header)
                    else:
                        StepHeader.decode(conn.recv_bytes())
                    dist.broadcast(buf, src=0, group=group.host_group)
                else:
                    box = [objects if rank == 0 else None]
                    dist.broadcast_object_list(box, src=0, group=group.host_group)
                dist.barrier()
                times.append(time.perf_counter() - start)
            results[(batch, method)] = float(np.median(times)) * 1e6
    dist.destroy_process_group()
    return results


def _worker(port: int, conn, iters: int) -> None:
    _run(1, join_store(port, 2, 60), conn, iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=500)
    args = ap.parse_args()
    store = open_store(2, 60)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(store.port, theirs, args.iters), daemon=True)
    proc.start()
    results = _run(0, store, ours, args.iters)
    proc.join()
    print(f"{'decode batch':>12} {'packed bytes':>12} {'packed us':>10} {'pickled us':>10}  (barrier subtracted)")
    for batch in BATCHES:
        shape, _ = _steps(batch)
        base = results[(batch, "barrier")]
        print(f"{batch:>12} {layout(shape)[1]:>12} {results[(batch, 'packed')] - base:>10.0f} "
              f"{results[(batch, 'pickled')] - base:>10.0f}")
    print(f"(per-step barrier {np.median([results[(b, 'barrier')] for b in BATCHES]):.0f} us; torch {torch.__version__})")


if __name__ == "__main__":
    main()
