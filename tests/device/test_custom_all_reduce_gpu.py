"""The symmetric-memory all-reduce on two GPUs (marked `gpu`, skipped without 2 GPUs): the engine's
call (`TPGroup.all_reduce`) equals NCCL's sum for messages on each path (one-shot, two-shot, and
NCCL above the bound), eager and replayed from a CUDA graph; the GEMM that writes into the buffer
sums like the one that does not. The engine with it on and off: tests/device/test_engine_tp_gpu.py."""
from __future__ import annotations

import os
import traceback

import pytest
import torch

from engine.distributed.all_reduce_path import NCCL, ONE_SHOT, TWO_SHOT
from engine.parallel_config import ParallelConfig
from tests.symmetric_memory_helpers import two_rank_reports

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
KiB = 2**10
# One-shot up to 64 KiB, two-shot up to 1 MiB, NCCL above: every path gets messages.
PARALLEL = ParallelConfig(2, disable_custom_all_reduce=False, custom_all_reduce_one_shot_max_bytes=64 * KiB,
                          custom_all_reduce_max_bytes=1024 * KiB)
# (rows, hidden) of bf16 and the path each takes.
MESSAGES = [((1, 4096), ONE_SHOT), ((8, 4096), ONE_SHOT), ((3, 1000), ONE_SHOT), ((9, 4096), TWO_SHOT),
            ((128, 4096), TWO_SHOT), ((129, 4096), NCCL), ((256, 4096), NCCL)]
DEADLINE_S = 240.0


def _check(group, rank: int) -> list[str]:
    """What differs from NCCL (empty: nothing)."""
    import torch.distributed as dist

    problems = []
    for shape, path in MESSAGES:
        x = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
        taken = group.custom.path_for(x)
        if taken != path:
            problems.append(f"{shape}: took {taken}, expected {path}")
        expected = x.clone()
        dist.all_reduce(expected, group=group.device_group)
        eager = group.all_reduce(x.clone())
        static = torch.zeros_like(x)
        for _ in range(2):  # warm-up outside the capture, as the engine does
            group.all_reduce(static.clone())
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = group.all_reduce(static.clone())
        static.copy_(x)
        graph.replay()
        graph.replay()  # the signal pads reset themselves: a second replay sums alike
        torch.cuda.synchronize()
        for label, got in (("eager", eager), ("graph", replayed)):
            if not torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2):
                err = (got.float() - expected.float()).abs().max().item()
                problems.append(f"{shape} {path} {label}: differs from NCCL by up to {err:.3g}")
        graph.reset()
    # A row-parallel layer's GEMM written into the buffer sums like F.linear's output.
    from engine.models.parallel_layers import RowParallelLinear

    layer = RowParallelLinear(512, 4096, False, group).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(layer.weight, generator=torch.Generator("cuda").manual_seed(10 + rank))
    x = torch.randn(16, 512, dtype=torch.bfloat16, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, layer.weight)
        dist.all_reduce(expected, group=group.device_group)
        got = layer(x)
    if not torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2):
        problems.append("RowParallelLinear through the symmetric buffer differs from NCCL")
    return problems


def _rank(rank: int, port: int, results) -> None:
    from engine.distributed.parallel_state import end_group, init_group, join_store

    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        group = init_group(join_store(port, 2, DEADLINE_S), rank, 2, torch.device("cuda", rank), DEADLINE_S, PARALLEL)
        if group.custom is None:
            results.put((rank, ["the symmetric-memory all-reduce is off (see the log line)"]))
            return
        results.put((rank, _check(group, rank)))
        torch.cuda.synchronize()
        group.custom = None
        end_group(4.0, 2.0)
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        results.put((rank, [f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"]))


def test_symmetric_all_reduce_equals_nccl_eager_and_in_graphs():
    assert two_rank_reports(_rank, DEADLINE_S) == {0: [], 1: []}
