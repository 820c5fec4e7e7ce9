"""Tensor parallelism's edges on CPU (gloo): sharding rules and their errors, the step header, and
faults: a worker killed or hung gives rank 0 a `WorkerFailure` within a bounded time and leaves no
process behind, and so does a worker that fails while starting; `close()` stops every worker and
ends within its bound when a worker or the group's teardown never answers; a start-up error of
rank 0 is raised as is."""
from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from engine.config import ModelConfig, RunnerConfig
from engine.device.batch_layout import BatchShape
from engine.distributed.driver import JOIN_TIMEOUT_S, TPModelRunner, WorkerFailure
from engine.distributed.sharding import TPShard
from engine.distributed.step_message import StepHeader
from engine.engine_args import EngineArgs
from engine.model_loader import load_model_config
from engine.offline.llm_engine import LLMEngine
from engine.parallel_config import ParallelConfig
from policies.request import SamplingParams

TIMEOUT_S = 5.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def test_shard_sizes_split_and_replicate_heads():
    cfg = load_model_config("tiny-llama")  # 4 heads, 2 KV heads, intermediate 128, vocab 256
    two = [TPShard.of(cfg, r, 2) for r in range(2)]
    assert [(s.num_heads, s.head_start, s.num_kv_heads, s.kv_head_start) for s in two] == [(2, 0, 1, 0), (2, 2, 1, 1)]
    four = [TPShard.of(cfg, r, 4) for r in range(4)]  # fewer KV heads than ranks: each pair shares one
    assert [(s.head_start, s.kv_head_start) for s in four] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert four[3].intermediate == 32 and four[3].local_config(cfg).num_key_value_heads == 1


def test_shard_vocab_pads_the_last_rank():
    cfg = load_model_config("tiny-llama")
    cfg.vocab_size = 250
    shards = [TPShard.of(cfg, r, 4) for r in range(4)]
    assert {s.vocab for s in shards} == {63}
    rows = [s.source_rows(cfg, "embed_tokens.weight", None) for s in shards]
    assert rows == [(0, 0, 63, 250), (0, 63, 63, 250), (0, 126, 63, 250), (0, 189, 61, 250)]


@pytest.mark.parametrize(("field", "value", "size"), [
    ("num_attention_heads", 6, 4), ("num_key_value_heads", 6, 4), ("intermediate_size", 130, 4)])
def test_shard_refuses_sizes_that_do_not_divide(field, value, size):
    cfg = load_model_config("tiny-llama")
    setattr(cfg, field, value)
    if field == "num_attention_heads":
        cfg.num_key_value_heads = 6
    with pytest.raises(ValueError, match=field):
        TPShard.of(cfg, 0, size)
    cfg = load_model_config("tiny-llama")  # 2 KV heads cannot be replicated evenly over 3 ranks
    cfg.num_attention_heads = 6
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        TPShard.of(cfg, 0, 3)


def test_engine_args_refuse_a_bad_size():
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="num_attention_heads=4 .* tensor_parallel_size=8"):
        LLMEngine(EngineArgs(model="tiny-llama", num_gpu_blocks=16, tensor_parallel_size=8))


pairs = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), max_size=5)


@given(shape=st.none() | st.builds(BatchShape, *[st.integers(0, 4096)] * 6), graph=st.booleans(),
       max_q=st.integers(0, 4096), rows=st.integers(0, 4096), fast=st.booleans(), seed=st.integers(0, 2**31 - 2),
       out=pairs, swap_in=pairs, copy=pairs)
def test_step_header_round_trips(shape, graph, max_q, rows, fast, seed, out, swap_in, copy):
    header = StepHeader(shape, graph, max_q, rows, fast, seed, dict(out), dict(swap_in), copy)
    assert StepHeader.decode(header.encode()) == header
    assert StepHeader.decode(StepHeader(stop=True).encode()).stop


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model="tiny-llama", num_gpu_blocks=64, max_model_len=128, swap_space=0.01,
                                tensor_parallel_size=2, distributed_timeout_s=TIMEOUT_S, **kw))


def _fail_within(engine: LLMEngine, bound_s: float) -> WorkerFailure:
    start = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < bound_s
    return info.value


def _assert_no_worker_left(engine: LLMEngine) -> None:
    for proc in engine.runner._procs:
        assert proc.exitcode is not None
        with pytest.raises(ProcessLookupError):
            os.kill(proc.pid, 0)
    assert not dist.is_initialized()


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_failed_worker_is_reported_in_bounded_time(how):
    engine = _engine()
    (worker,) = engine.runner._procs
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.step()
    os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    error = _fail_within(engine, TIMEOUT_S + 15)
    if how == "killed":
        assert f"worker 1 (pid {worker.pid}) died" in str(error) and "exit code -9" in str(error)
    else:
        assert "did not answer within timeout_s=5.0" in str(error)
    _assert_no_worker_left(engine)
    with pytest.raises(WorkerFailure):  # the engine stays failed
        engine.step()


def test_close_stops_the_workers_and_frees_the_group():
    engine = _engine()
    procs = list(engine.runner._procs)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    assert [p.exitcode for p in procs] == [0]
    _assert_no_worker_left(engine)
    engine.close()  # idempotent


def test_a_start_up_error_is_raised_as_is_and_leaves_no_process():
    with pytest.raises(ValueError, match="num_gpu_blocks=2 is invalid: its KV pool"):
        LLMEngine(EngineArgs(model="tiny-llama", num_gpu_blocks=2, max_model_len=128, tensor_parallel_size=2))
    assert not dist.is_initialized()
    assert not [p for p in __import__("multiprocessing").active_children() if p.name.startswith("servelab-tp")]


def _raise_in_worker():
    raise RuntimeError("injected start-up failure")


def _missing_weights(values: dict) -> ModelConfig:
    return ModelConfig(**{**values, "weights": "/nonexistent/servelab-weights"})


class _FailsInWorker(ModelConfig):
    """Rank 0's model config; the copy a worker unpickles fails there: while it starts (before it
    reports anything) or once it joined the group (its weights are missing)."""

    __slots__ = ("when",)

    def __reduce__(self):
        if self.when == "before-joining":
            return _raise_in_worker, ()
        return _missing_weights, ({f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)},)


@pytest.mark.parametrize("when", ["before-joining", "after-joining"])
def test_a_worker_that_fails_while_starting_is_reported_within_seconds(when):
    """Not at the start-up deadline (STARTUP_TIMEOUT_S, 15 minutes): the error names the rank, its
    exit code and, when it could report one, its error."""
    base = load_model_config("tiny-llama")
    config = _FailsInWorker(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)})
    config.when = when
    args = EngineArgs(model="tiny-llama", num_gpu_blocks=64, max_model_len=128, swap_space=0.01)
    start = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        TPModelRunner(RunnerConfig(config, args.cache_config(), max_num_batched_tokens=256, max_num_seqs=16,
                                   max_model_len=128), ParallelConfig(tensor_parallel_size=2, timeout_s=TIMEOUT_S))
    assert time.monotonic() - start < 90  # spawn and import torch on a busy machine; not 900 s
    assert "worker 1 (pid" in str(info.value) and "exit code 1" in str(info.value)
    if when == "after-joining":
        assert "/nonexistent/servelab-weights" in str(info.value)
    assert not dist.is_initialized()
    assert not [p for p in __import__("multiprocessing").active_children() if p.name.startswith("servelab-tp")]


def test_close_is_bounded_when_a_worker_never_answers():
    engine = _engine()
    (worker,) = engine.runner._procs
    os.kill(worker.pid, signal.SIGSTOP)  # never reads the stop message nor ends its side of the group
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < JOIN_TIMEOUT_S + 2
    assert worker.exitcode == -signal.SIGKILL
    _assert_no_worker_left(engine)


def test_close_is_bounded_when_the_group_teardown_hangs(monkeypatch):
    """NCCL's destroy may wait for a rank that is gone: close aborts the group instead, in time."""
    release = threading.Event()
    destroy = dist.destroy_process_group
    engine = _engine()
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait() and dist.is_initialized() and destroy())
    closing = threading.Thread(target=engine.close, daemon=True)
    closing.start()
    closing.join(JOIN_TIMEOUT_S + 2)
    release.set()
    assert not closing.is_alive(), "close() did not return within its bound"
    assert not dist.is_initialized()  # aborted
    _assert_no_worker_left(engine)


@pytest.mark.parametrize("failed", [False, True], ids=["close", "close-after-a-failure"])
def test_the_shutdown_frees_the_graphs_before_the_teardown_waits_for_them(failed, monkeypatch):
    """NCCL's destroy and abort do not return while a CUDA graph that captured a collective still
    holds the communicator (simulated here on a one-rank gloo group): the shutdown frees rank 0's
    graphs first (after a failure: starts the abort, then frees them), so it ends at once."""
    from engine.distributed import shutdown
    from engine.distributed.parallel_state import init_group, open_store

    released = threading.Event()

    class Graphs:
        def release(self):
            released.set()

    def waits_for_the_graphs(teardown):
        def fn(*args, **kwargs):
            released.wait()
            teardown(*args, **kwargs)
        return fn

    if failed:
        monkeypatch.setattr(shutdown, "abort_group", waits_for_the_graphs(shutdown.abort_group))
    else:
        monkeypatch.setattr(dist, "destroy_process_group", waits_for_the_graphs(dist.destroy_process_group))
    init_group(open_store(1, 10), 0, 1, __import__("torch").device("cpu"), 10)
    start = time.monotonic()
    shutdown.WorkerShutdown(graphs=Graphs(), group_open=True).run(JOIN_TIMEOUT_S, failed=failed)
    assert time.monotonic() - start < 1.0  # not the destroy's or the abort's bound
    assert not dist.is_initialized()


def test_a_stuck_shutdown_leaves_the_graphs_and_the_group_and_ends_the_workers(monkeypatch):
    """Rank 0's GPU spinning in a symmetric-memory all-reduce that a dead worker never joined: freeing
    the graphs or aborting the group would wait behind that kernel (holding the GIL), so a stuck
    shutdown touches neither and only ends the workers, at once."""
    from engine.distributed import shutdown

    touched = []

    class Graphs:
        def release(self):
            touched.append("graphs")

    monkeypatch.setattr(shutdown, "abort_group", lambda: touched.append("abort"))
    monkeypatch.setattr(shutdown, "end_group", lambda *a: touched.append("end"))
    ctx = multiprocessing.get_context("spawn")
    worker = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    worker.start()
    start = time.monotonic()
    shutdown.WorkerShutdown(procs=[worker], graphs=Graphs(), group_open=True).run(2.0, failed=True, stuck=True)
    assert time.monotonic() - start < 3.0
    assert touched == [] and worker.exitcode is not None


@pytest.mark.parametrize("custom", [False, True], ids=["nccl", "symmetric-memory"])
def test_the_watchdog_aborts_the_group_only_where_an_abort_can_end_the_step(custom, monkeypatch):
    """A worker's death: the watchdog flags it at once; it aborts the group only when every
    all-reduce is NCCL's (the symmetric-memory kernels ignore an abort, which would then block)."""
    import types
    import weakref

    from engine.distributed import driver

    aborted = []
    monkeypatch.setattr(driver, "abort", aborted.append)
    tp = types.SimpleNamespace(custom=object() if custom else None)
    class Runner:  # what the watchdog reads of a TPModelRunner (held weakly)
        _closed, _worker_died, _rank0_device = False, threading.Event(), types.SimpleNamespace(type="cuda")

    runner = Runner()
    runner.tp = tp
    worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,), daemon=True)
    worker.start()
    watch = threading.Thread(target=driver._watch, args=(weakref.ref(runner), [worker.sentinel]), daemon=True)
    watch.start()
    watch.join(10)
    assert not watch.is_alive() and runner._worker_died.is_set()
    assert aborted == ([] if custom else [tp])


def test_the_tensor_parallel_path_at_one_rank_matches_the_plain_runner():
    """No worker: rank 0's group, sharded model and step messages alone (the GPU smoke test's path)."""
    args = EngineArgs(model="tiny-qwen3", num_gpu_blocks=64, max_model_len=128, swap_space=0.01)
    config = RunnerConfig(args.model_config(), args.cache_config(), max_num_batched_tokens=256, max_num_seqs=16,
                          max_model_len=128)
    runner = TPModelRunner(config, ParallelConfig(tensor_parallel_size=1))
    outputs = []
    for engine in (LLMEngine(args, runner=runner), LLMEngine(args)):
        engine.add_request("a", list(range(1, 30)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():
            outputs += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    runner.close()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8
    assert not dist.is_initialized()


def test_an_engine_dropped_without_close_stops_its_workers():
    engine = _engine()
    procs = list(engine.runner._procs)
    del engine
    gc.collect()
    assert [p.exitcode for p in procs] == [0]
    assert not dist.is_initialized()  # a new tensor-parallel engine can start


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("weights", ["checkpoint", "dummy"])
def test_shards_take_their_part_of_the_full_weights(size, weights):
    """The loader every source goes through (HF dir, GGUF, dummy): rank shards put back together are
    the single-GPU model, with q/k/v bias, a replicated o_proj bias, tied vocab-parallel embeddings
    and a vocabulary (250) that does not divide (zero padding)."""
    import dataclasses

    import torch

    from engine.device.attention import attention_ops
    from engine.device.weights import dummy_hf_items, init_dummy, load_hf_state_dict, to_hf_state_dict
    from engine.models.llama import LlamaForCausalLM, ShardedLlamaForCausalLM
    from engine.models.parallel_layers import TPContext

    cfg = dataclasses.replace(load_model_config("tiny-llama"), vocab_size=250, tie_word_embeddings=True,
                              attention_bias=True)
    ops = attention_ops("reference", torch.device("cpu"))
    full = LlamaForCausalLM(cfg, ops)
    init_dummy(full, seed=3)
    ranks = []
    for rank in range(size):
        shard = TPShard.of(cfg, rank, size)
        model = ShardedLlamaForCausalLM(cfg, ops, tp=TPContext(shard, None))
        items = to_hf_state_dict(full).items() if weights == "checkpoint" else dummy_hf_items(model, seed=3)
        load_hf_state_dict(model, items, shard)
        ranks.append(model)
    d, q_local = cfg.head_dim, cfg.num_attention_heads // size * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        want, got = full.layers[i], [m.layers[i] for m in ranks]
        q = torch.cat([g.self_attn.qkv_proj.weight[:q_local] for g in got])
        assert torch.equal(q, want.self_attn.qkv_proj.weight[:cfg.num_attention_heads * d])
        k_full = want.self_attn.qkv_proj.weight[cfg.num_attention_heads * d:][:cfg.num_key_value_heads * d]
        for rank, g in enumerate(got):
            kv_head = rank * cfg.num_key_value_heads // size if size > cfg.num_key_value_heads else rank
            k = g.self_attn.qkv_proj.weight[q_local:q_local + d * max(1, cfg.num_key_value_heads // size)]
            assert torch.equal(k, k_full[kv_head * d:kv_head * d + len(k)])
            assert torch.equal(g.self_attn.o_proj.bias, want.self_attn.o_proj.bias)  # added once, after the sum
        assert torch.equal(torch.cat([g.self_attn.o_proj.weight for g in got], 1), want.self_attn.o_proj.weight)
        assert torch.equal(torch.cat([g.mlp.down_proj.weight for g in got], 1), want.mlp.down_proj.weight)
    embed = torch.cat([m.embed_tokens.weight for m in ranks])
    assert torch.equal(embed[:250], full.embed_tokens.weight) and not embed[250:].any()


@given(kv=st.sampled_from([1, 2, 4, 8]), group=st.sampled_from([1, 2, 4]), size=st.sampled_from([1, 2, 4, 8]))
def test_every_q_head_is_on_one_rank_with_the_kv_head_it_reads(kv, group, size):
    """For every split the rule allows: the ranks' q heads partition all heads, and each rank holds
    the KV heads its q heads read (GQA groups never straddle a replicated KV head)."""
    import dataclasses

    heads = kv * group
    cfg = dataclasses.replace(load_model_config("tiny-llama"), num_attention_heads=heads, num_key_value_heads=kv)
    try:
        shards = [TPShard.of(cfg, r, size) for r in range(size)]
    except ValueError:
        assert heads % size or (kv < size and size % kv) or (kv >= size and kv % size)
        return
    owned = [h for s in shards for h in range(s.head_start, s.head_start + s.num_heads)]
    assert owned == list(range(heads))
    for s in shards:
        read = {h // group for h in range(s.head_start, s.head_start + s.num_heads)}
        assert read <= set(range(s.kv_head_start, s.kv_head_start + s.num_kv_heads))
