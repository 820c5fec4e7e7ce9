"""Sequence-parallel steps on two GPUs (marked `gpu`, skipped without 2 GPUs; run this file in a
pytest process of its own: torch's symmetric-memory rendezvous meets once per process, so only the
process's first tensor-parallel engine has the fused ops).

- The group's fused boundaries (torch's `symm_mem.fused_all_gather_matmul` and
  `fused_matmul_reduce_scatter`, with the weights transposed as views) equal NCCL's all-gather +
  matmul and matmul + reduce-scatter in bf16, at prefill sizes up to 16,384 rows of Qwen3-8B's
  widths, the workspace growing between calls; two spawned ranks.
- Qwen3-0.6B engines at N = 2 with `sequence_parallel_min_rows` low, CUDA graphs on (decode steps
  and small prefills replay graphs, larger steps run eagerly and sequence-parallel): bf16 greedy
  tokens agree with one GPU by tests/device/test_engine_tp_gpu.py's rule, over the fused ops (the
  process's first TP engine) and over NCCL (`disable_custom_all_reduce`)."""
from __future__ import annotations

import os
import traceback

import pytest
import torch
from test_engine_sequence_parallel import counting_sequence_parallel
from test_engine_tp_gpu import ARGS, PROMPTS, _agree, _generate

from engine.distributed import custom_all_reduce
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from engine.parallel_config import ParallelConfig
from tests.symmetric_memory_helpers import two_rank_reports

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
DEADLINE_S = 300.0
# (rows of the whole step, in, out) per call, in this order: the workspace grows, then is reused.
# Qwen3-8B at N = 2: hidden 4096, q/k/v 3072 and gate/up 12288 columns per rank, o_proj in 2048 and
# down_proj in 6144 per rank.
GATHERS = [(34, 4096, 3072), (2048, 4096, 12288), (16384, 4096, 3072), (16384, 4096, 12288), (512, 4096, 3072)]
SCATTERS = [(34, 2048, 4096), (2048, 6144, 4096), (16384, 2048, 4096), (16384, 6144, 4096), (512, 6144, 4096)]
# The engine's threshold: the first prefill step (every prompt, 556 tokens) and most later ones
# run sequence-parallel; decode steps (<= 8 rows) replay graphs.
MIN_ROWS = 64


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the largest magnitude (bf16 sums in another order)."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def _check_ops(group, rank: int) -> list[str]:
    from engine.distributed.row_collectives import plain_all_gather_matmul, plain_matmul_reduce_scatter

    problems = []
    gen = torch.Generator("cuda").manual_seed(rank)

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda", generator=gen) * 0.05

    for rows, k, n in GATHERS:
        x, w = rand(rows // 2, k), rand(n, k)
        got, want = group.all_gather_matmul(x, w), plain_all_gather_matmul(x, w, 2, group.device_group)
        if got.shape != (rows, n) or _close(got, want) > 2e-2:
            problems.append(f"all_gather_matmul {rows}x{k}->{n}: shape {tuple(got.shape)}, off {_close(got, want):.3g}")
    for rows, k, n in SCATTERS:
        x, w = rand(rows, k), rand(n, k)
        got, want = group.matmul_reduce_scatter(x, w), plain_matmul_reduce_scatter(x, w, 2, group.device_group)
        if got.shape != (rows // 2, n) or _close(got, want) > 2e-2:
            problems.append(f"matmul_reduce_scatter {rows}x{k}->{n}: shape {tuple(got.shape)}, "
                            f"off {_close(got, want):.3g}")
    torch.cuda.synchronize()
    return problems


def _rank(rank: int, port: int, results) -> None:
    from engine.distributed.parallel_state import end_group, init_group, join_store

    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        group = init_group(join_store(port, 2, DEADLINE_S), rank, 2, torch.device("cuda", rank), DEADLINE_S,
                           ParallelConfig(2, sequence_parallel_min_rows=1))
        if group.fused_rows is None:
            results.put((rank, ["no fused ops: the symmetric-memory all-reduce is off (see the log line)"]))
            return
        results.put((rank, _check_ops(group, rank)))
        group.custom = group.fused_rows = None
        end_group(4.0, 2.0)
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        results.put((rank, [f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"]))


def test_fused_boundaries_equal_nccl():
    assert two_rank_reports(_rank, DEADLINE_S) == {0: [], 1: []}


@pytest.mark.parametrize("nccl", [False, True], ids=["fused", "nccl"])
def test_tp2_sequence_parallel_bf16_greedy_agrees_with_one_gpu(nccl, monkeypatch):
    with LLMEngine(EngineArgs(**ARGS)) as engine:
        reference = _generate(engine)
    fused = not nccl and not custom_all_reduce._rendezvous_joined  # the process's first symmetric-memory engine
    args = EngineArgs(**ARGS, tensor_parallel_size=2, sequence_parallel_min_rows=MIN_ROWS,
                      disable_custom_all_reduce=nccl)
    with LLMEngine(args) as engine:
        assert (engine.runner.tp.fused_rows is not None) == fused
        assert all(t < MIN_ROWS for t in engine.runner.graphs.token_sizes)
        rows = counting_sequence_parallel(monkeypatch)
        tokens = _generate(engine)
    print(f"\n[sequence parallel] {'fused' if fused else 'NCCL'}: {len(rows)} steps, rows {rows}")
    assert min(rows) >= MIN_ROWS and sum(map(len, PROMPTS)) in rows  # the first step: every prompt
    assert _agree(tokens, reference, f"N=2 sequence-parallel ({'fused' if fused else 'NCCL'}) vs N=1") >= 5 / 6
