"""A tensor-parallel worker: one process per rank 1..N-1, spawned by rank 0 (`engine.distributed.driver`).

It reports "joining" down its pipe, joins the group, builds its `ModelRunner` (its shard, its KV
cache, its CUDA graphs: every rank captures the same graphs in the same order, collectives
included), reports "ready" (or, at any point, its error), then serves steps until rank 0 says stop
or is gone: each step applies the cache operations of the header, receives the input bytes and
runs the same forward as rank 0 (a graph replay or eager), whose all-reduces pair with rank 0's,
then its part of the step's sampling (its vocabulary columns' best in the fast path's exchange, or
its columns of the logits gathered for rank 0's full sampler). Only rank 0 keeps the tokens.

On stop it frees its CUDA graphs, ends its side of the group within the bounds rank 0 uses
(`engine.distributed.shutdown`) and leaves with `os._exit`. It ends on its own when rank 0's
process ends: the pipe reads end of file, and a watchdog thread exits the process if rank 0 dies
while this one waits inside a collective.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import traceback
from multiprocessing.connection import Connection, wait

import torch

from engine.config import RunnerConfig
from engine.distributed.parallel_state import end_group, init_group, join_store
from engine.distributed.shutdown import ABORT_S, DESTROY_S
from engine.distributed.step_message import StepHeader, broadcast_inputs
from engine.parallel_config import ParallelConfig


def exit_with_parent(name: str = "tp-parent-watchdog") -> None:
    """End this spawned process at once when its parent's process ends (a watchdog thread)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name=name, daemon=True).start()


def worker_main(rank: int, size: int, port: int, device: str, config: RunnerConfig, parallel: ParallelConfig,
                startup_s: float, timeout_s: float, conn: Connection) -> None:
    """`startup_s`: the collectives' deadline while ranks start; `timeout_s`: while serving steps."""
    exit_with_parent()
    from engine.device.model_runner import ModelRunner

    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        conn.send(("joining", os.getpid()))
        group = init_group(join_store(port, size, startup_s), rank, size, dev, startup_s, parallel)
        runner = ModelRunner.from_config(config, device=dev, tp=group)
        group.set_timeout(timeout_s)
        conn.send(("ready", os.getpid()))
        serve(runner, group.device_group, conn)
        runner.close()  # the CUDA graphs before the communicator their all-reduces use
    except BaseException as e:  # noqa: BLE001 (reported to rank 0, which raises it with context)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        except OSError:
            pass
        os._exit(1)
    end_group(DESTROY_S, ABORT_S)
    # Skip the interpreter's teardown: the group's C++ threads may still be winding down (or a
    # teardown helper be stuck in NCCL), and destroying them there can block or abort the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@torch.no_grad()
def serve(runner, device_group, conn: Connection) -> None:
    while True:
        try:
            header = StepHeader.decode(conn.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if header.stop:
            return
        runner.kv_cache.apply(header.swap_out, header.swap_in, header.copy)
        shape = header.shape
        if shape is None:
            continue
        if header.graph:
            inputs = runner.graphs.inputs[shape]
        else:
            inputs = runner.batch.views(shape, header.max_seqlen_q)
        broadcast_inputs(runner.batch.buffers, shape, device_group)
        logits = runner.forward_inputs(shape if header.graph else None, inputs, shape.num_sample_rows > 0)
        rows = header.sample_rows
        if rows and header.fast_sampling:  # this rank's part of rank 0's draw
            runner.sample_shard(logits[:rows], inputs.temperatures[:rows], header.seed)
        elif rows:  # rank 0's full sampler needs every column
            runner.model.gather_logits(logits[:rows])
