"""The sequence-parallel layer boundaries on CPU (gloo): the group's row collectives against a plain
matmul + all-reduce; a tiny shard's sequence-parallel forward against its all-reduce forward
(hidden states and logits, on steps whose rows are not a multiple of the ranks: padding) at 2 and 4
ranks; the fused ops' wrapper (`FusedRowOps`: arguments, pacing, its error); which steps take the
path and which get CUDA graphs. tests/device/test_engine_sequence_parallel.py runs whole engines."""
from __future__ import annotations

import traceback
from functools import partial

import pytest
import torch
from engine_model_helpers import BlockAllocator, make_seqs, random_prompts
from symmetric_memory_helpers import two_rank_reports

from engine.device.cuda_graph import graph_token_sizes
from engine.distributed.parallel_state import TPGroup
from engine.distributed.row_collectives import FusedRowOps, SequenceParallelError
from engine.parallel_config import ParallelConfig

DEADLINE_S = 120.0


def _expect(problems: list[str], what: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    if got.shape != want.shape:
        problems.append(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    elif not torch.allclose(got, want, rtol=tol, atol=tol):
        problems.append(f"{what}: off by {(got - want).abs().max().item():.3g}")


def _rank_tensor(rank: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + rank))


def _check_collectives(group: TPGroup) -> list[str]:
    """Every rank knows every rank's inputs (seeded by rank), so each builds its references alone."""
    import torch.distributed as dist

    problems: list[str] = []
    n, r, s = group.size, group.rank, 3
    xs = [_rank_tensor(q, n * s, 5) for q in range(n)]  # rank q's [N S, 5]
    total = sum(xs)
    _expect(problems, "reduce_scatter_rows", group.reduce_scatter_rows(xs[r]), total[r * s:(r + 1) * s])
    shards = [_rank_tensor(q, s, 5) for q in range(n)]  # rank q's [S, 5]
    _expect(problems, "all_gather_rows", group.all_gather_rows(shards[r]), torch.cat(shards))
    weights = [_rank_tensor(10 + q, 7, 5) for q in range(n)]  # column-parallel: rank q's [out 7, in 5]
    _expect(problems, "all_gather_matmul", group.all_gather_matmul(shards[r], weights[r]),
            torch.cat(shards) @ weights[r].T)
    # Row-parallel: rank q's input columns [N S, 4] and weight [out 6, in 4]; the reference is the
    # all-reduce path's: matmul, then all-reduce, then this rank's rows.
    cols, w_rows = _rank_tensor(20 + r, n * s, 4), _rank_tensor(30 + r, 6, 4)
    reference = cols @ w_rows.T
    dist.all_reduce(reference, group=group.device_group)
    _expect(problems, "matmul_reduce_scatter", group.matmul_reduce_scatter(cols, w_rows), reference[r * s:(r + 1) * s])
    fused = _torch_reference_ops(group)
    if fused is not None:  # the fused ops' arguments, as torch's own reference of their semantics reads them
        _expect(problems, "fused all_gather_matmul (torch's reference)", fused.all_gather_matmul(shards[r], weights[r]),
                torch.cat(shards) @ weights[r].T)
        _expect(problems, "fused matmul_reduce_scatter (torch's reference)", fused.matmul_reduce_scatter(cols, w_rows),
                reference[r * s:(r + 1) * s])
    try:
        group.reduce_scatter_rows(xs[r][:n * s - 1])
        problems.append("reduce_scatter_rows took rows that are not a multiple of the ranks")
    except ValueError as e:
        if "pad to a multiple" not in str(e):
            problems.append(f"reduce_scatter_rows' error: {e}")
    return problems


def _torch_reference_ops(group: TPGroup) -> FusedRowOps | None:
    """`FusedRowOps` over torch's reference implementations of its fused ops (what they compute,
    with functional collectives: they run on gloo), or None if this torch has none."""
    from types import SimpleNamespace

    import torch.distributed._symmetric_memory as symm

    gather = getattr(symm, "_fused_all_gather_matmul_fallback", None)
    scatter = getattr(symm, "_fused_matmul_reduce_scatter_fallback", None)
    if gather is None or scatter is None:
        return None
    ops = SimpleNamespace(fused_all_gather_matmul=gather, fused_matmul_reduce_scatter=scatter)
    return FusedRowOps(group.device_group.group_name, group.rank, lambda kernel: kernel(), ops=ops)


def _prefill_and_decode(runner, prompts: list[list[int]]):
    """The ModelInputs of one prefill step of `prompts` and of the decode step after it (one token each)."""
    from policies.outputs import ScheduledSeq
    from policies.request import SamplingParams

    seqs = make_seqs(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    alloc = BlockAllocator(runner.block_size, runner.num_gpu_blocks)
    for seq in seqs:
        alloc.ensure(seq, seq.num_tokens + 1)
    prefill = runner.batch.prepare(*_planned(runner, [ScheduledSeq(s, s.num_tokens, 1) for s in seqs]))
    yield prefill
    for i, seq in enumerate(seqs):
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(1 + i)
    yield runner.batch.prepare(*_planned(runner, [ScheduledSeq(s, 1, 1) for s in seqs]))


def _planned(runner, scheduled):
    plan = runner.batch.plan(scheduled)
    return plan, plan.shape()


def _check_model(group: TPGroup, arch: str, lens: list[int]) -> list[str]:
    """A shard's sequence-parallel forward equals its all-reduce forward: a prefill step of
    sum(lens) rows, then the decode step (len(lens) rows) reading what each wrote to the KV cache."""
    from engine.config import CacheConfig
    from engine.device.model_runner import ModelRunner
    from engine.model_loader import load_model_config

    problems: list[str] = []
    cfg = load_model_config(f"tiny-{arch}")
    runner = ModelRunner(cfg, CacheConfig(block_size=4, num_gpu_blocks=64, swap_space=0.0), max_num_batched_tokens=256,
                         max_num_seqs=8, max_model_len=64, tp=group)
    model = runner.model
    for step, inputs in zip(("prefill", "decode"), _prefill_and_decode(runner, random_prompts(lens, cfg.vocab_size))):
        args = (inputs.input_ids, inputs.positions, inputs.meta)
        rows = inputs.input_ids.shape[0]
        if rows % group.size == 0:
            problems.append(f"{arch} {step}: {rows} rows, a multiple of {group.size} (padding not exercised)")
        reduced = model(*args, sequence_parallel=False)  # each writes the same K/V (the decode step reads them)
        split = model(*args, sequence_parallel=True)
        chosen = model(*args)  # sequence_parallel_min_rows=1: every step of 2+ ranks takes the path
        what = f"{arch} {step} ({rows} rows over {group.size} ranks)"
        _expect(problems, f"{what} hidden states", split, reduced, tol=1e-4)
        if not torch.equal(chosen, split):
            problems.append(f"{what}: the default choice did not take the sequence-parallel path")
        logits = [model.gather_logits(model.compute_local_logits(h[inputs.sample_rows])) for h in (split, reduced)]
        _expect(problems, f"{what} logits", *logits, tol=1e-4)
        if not torch.equal(logits[0].argmax(-1), logits[1].argmax(-1)):
            problems.append(f"{what}: greedy tokens differ")
    runner.close()
    return problems


BOUNDARY_CALLS = ("all_gather_matmul", "matmul_reduce_scatter", "reduce_scatter_rows", "all_gather_rows")


def _check_priced_calls(group: TPGroup, lens: list[int]) -> list[str]:
    """The simulator prices the calls the engine makes: a tiny Qwen3 shard's sequence-parallel
    forward records its group's boundaries ((op, m, k, n) of each fused GEMM, the bytes of each row
    collective) and the rows of its layer norms, q/k norm + rope + KV writes, SiLUs and embedding,
    in order, which equal `SequenceParallelPricing`'s list for the same shard and rows (the first
    layer's plain input norm counted as the `add_rms_norm` it is priced as)."""
    from hydra import compose, initialize_config_module

    from engine.config import CacheConfig
    from engine.device.model_runner import ModelRunner
    from engine.model_loader import load_model_config
    from experiments.lib import factory
    from sim.latency.sequence_parallel_pricing import SequenceParallelPricing
    from sim.latency.tensor_parallel import shard_shape

    cfg = load_model_config("tiny-qwen3")
    runner = ModelRunner(cfg, CacheConfig(block_size=4, num_gpu_blocks=64, swap_space=0.0), max_num_batched_tokens=256,
                         max_num_seqs=8, max_model_len=64, tp=group)
    inputs = next(_prefill_and_decode(runner, random_prompts(lens, cfg.vocab_size)))
    seen: list[tuple] = []
    originals = {name: getattr(TPGroup, name) for name in BOUNDARY_CALLS}
    from engine.models import llama, parallel_layers

    fns = runner.model.layers[0].mlp.fns
    patched = [(llama.ReducingRMSNorm, "forward", "add_rms_norm"), (llama.ReducingRMSNorm, "add_forward", "add_rms_norm"),
               (llama.Attention, "attend_rows", "qk_rope_write"), (fns, "silu_and_mul", "silu_and_mul"),
               (parallel_layers.VocabParallelEmbedding, "lookup", "embedding")]
    kept = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patched]

    def rows_of(op, fn, bound):
        def call(*args, **kwargs):
            x = args[1] if bound else args[0]
            if op == "qk_rope_write":
                x = args[2]  # attend_rows(self, rope, qkv, meta): the rows it writes
            seen.append((op, x.shape[0]))
            return fn(*args, **kwargs)
        return call

    def recording(name):
        def call(self, x, weight=None):
            if weight is None:  # a row collective: its message's bytes (the gathered output, the scattered input)
                rows = x.shape[0] * (self.size if name == "all_gather_rows" else 1)
                seen.append((name.removesuffix("_rows"), rows * x.shape[1] * x.element_size()))
                return originals[name](self, x)
            rows = x.shape[0] * (self.size if name == "all_gather_matmul" else 1)
            seen.append((name, rows, weight.shape[1], weight.shape[0]))
            return originals[name](self, x, weight)
        return call
    try:
        for name in BOUNDARY_CALLS:
            setattr(TPGroup, name, recording(name))
        for (owner, attr, op), (_, _, fn) in zip(patched, kept, strict=True):
            setattr(owner, attr, rows_of(op, fn, bound=owner is not fns))
        runner.model(inputs.input_ids, inputs.positions, inputs.meta, sequence_parallel=True)
    finally:
        for name, fn in originals.items():
            setattr(TPGroup, name, fn)
        for owner, attr, fn in kept:
            setattr(owner, attr, fn)
        runner.close()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        model = shard_shape(factory.model_shape(compose(config_name="config", overrides=["model=tiny-qwen3"])),
                            group.size)
    priced = SequenceParallelPricing.layout(model, group.size, 1, fused=True).calls(sum(lens))
    want = [(op, x) if k == 0 else (op, x, k, n) for op, x, k, n in priced]
    return [] if seen == want else [f"the engine's calls {seen} != the priced {want}"]


def _rank(world: int, rank: int, port: int, results) -> None:
    from engine.distributed.parallel_state import end_group, init_group, join_store

    try:
        group = init_group(join_store(port, world, DEADLINE_S), rank, world, torch.device("cpu"), DEADLINE_S,
                           ParallelConfig(world, sequence_parallel_min_rows=1))
        problems = [] if world > 2 else _check_collectives(group) + _check_priced_calls(group, [5, 8, 4])
        for arch in ("qwen3", "qwen2", "llama"):  # Qwen2: the q/k/v bias, added after the gathered GEMM
            problems += _check_model(group, arch, [5, 8, 4] if world == 2 else [6, 7, 2])
        results.put((rank, problems))
        end_group(4.0, 2.0)
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        results.put((rank, [f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"]))


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_shards_match_the_all_reduce_path(world):
    assert two_rank_reports(partial(_rank, world), DEADLINE_S, world=world) == {r: [] for r in range(world)}


class StandInOps:
    """torch.ops.symm_mem's fused ops as one rank of one would compute them; records the calls."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def fused_all_gather_matmul(self, a, bs, gather_dim, group_name, *, return_A):
        self.calls.append(("ag", tuple(bs[0].shape), gather_dim, group_name, return_A, a.is_contiguous()))
        if self.fail:
            raise RuntimeError("workspace exhausted")
        return (a if return_A else None), [a @ b for b in bs]

    def fused_matmul_reduce_scatter(self, a, b, reduce_op, scatter_dim, group_name):
        self.calls.append(("rs", tuple(b.shape), reduce_op, scatter_dim, group_name, a.is_contiguous()))
        return a @ b


def test_the_fused_ops_get_the_weights_transposed_through_the_pacing():
    ops, launched = StandInOps(), []

    def launch(kernel):
        launched.append(kernel)
        return kernel()

    fused = FusedRowOps("g", 0, launch, keep_gathered=False, ops=ops)
    x, w = torch.randn(4, 6).t(), torch.randn(5, 4)  # a strided input: handed over contiguous
    # The stand-in multiplies the contiguous copy: the same products, summed in BLAS's own order.
    torch.testing.assert_close(fused.all_gather_matmul(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.matmul_reduce_scatter(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    assert ops.calls == [("ag", (4, 5), 0, "g", False, True), ("rs", (4, 5), "sum", 0, "g", True)]
    assert len(launched) == 2
    FusedRowOps("g", 0, launch, keep_gathered=True, ops=ops).all_gather_matmul(x, w)
    assert ops.calls[-1][4] is True  # return_A: torch's multicast branch never taken


def test_a_failed_fused_op_raises_a_sequence_parallel_error():
    fused = FusedRowOps("g", 1, lambda kernel: kernel(), ops=StandInOps(fail=True))
    with pytest.raises(SequenceParallelError, match=r"rank 1: symm_mem.fused_all_gather_matmul failed on x \(4, 4\)"
                       r".*workspace exhausted.*sequence_parallel_min_rows=0"):
        fused.all_gather_matmul(torch.ones(4, 4), torch.ones(3, 4))


def test_the_group_sends_its_boundaries_to_the_fused_ops_when_it_has_them():
    ops = StandInOps()
    group = TPGroup(0, 1, None, None, fused_rows=FusedRowOps("g", 0, lambda kernel: kernel(), ops=ops))
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    group.all_gather_matmul(x, w)
    group.matmul_reduce_scatter(x, w)
    assert [c[0] for c in ops.calls] == ["ag", "rs"]


@pytest.mark.parametrize(("size", "min_rows", "rows", "takes"), [
    (2, 0, 10_000, False),  # off
    (1, 8, 10_000, False),  # one rank: nothing to split
    (2, 8, 7, False),
    (2, 8, 8, True),
    (4, 2048, 16384, True),
])
def test_which_steps_take_the_path(size, min_rows, rows, takes):
    group = TPGroup(0, size, None, None, sequence_parallel_min_rows=min_rows)
    assert group.takes_sequence_parallel(rows) is takes
    assert group.sequence_parallel_from == (min_rows if size > 1 else 0)


def test_a_step_that_replays_a_graph_keeps_the_all_reduces():
    """The one rule the simulator's prices share: a step no larger than its kind's largest captured
    size replays a graph (captured on the all-reduce path), whatever the setting."""
    from policies.sequence_parallel import takes_sequence_parallel

    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert not takes_sequence_parallel(2, 128, 256, batches)  # a decode batch of a captured size
    assert takes_sequence_parallel(2, 128, 257, batches) and takes_sequence_parallel(2, 128, 256)
    assert not takes_sequence_parallel(2, 128, 100, [])
    assert not takes_sequence_parallel(1, 128, 4096, batches)


def test_no_graph_is_captured_for_sequence_parallel_steps():
    assert graph_token_sizes(16384, 2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2047]
    assert graph_token_sizes(1024, 4096) == graph_token_sizes(1024)
    assert graph_token_sizes(1024, 1) == []


def test_a_negative_threshold_is_refused_by_name():
    with pytest.raises(ValueError, match=r"sequence_parallel_min_rows=-1 is invalid: an integer >= 0 \(0: off"):
        ParallelConfig(2, sequence_parallel_min_rows=-1)
    with pytest.raises(ValueError, match=r"sequence_parallel_min_rows=True is invalid"):
        ParallelConfig(2, sequence_parallel_min_rows=True)
