"""Prefill/decode disaggregation on two GPUs (NCCL): the KV link moves blocks from cuda:0 to cuda:1
exactly, and its start-up transfer leaves both caches as they were; a prefill engine on cuda:0 and
a decode engine on cuda:1 give the single engine's greedy tokens in bf16 (the agreement count
printed with -s, as the tensor-parallel tests do), with CUDA graphs and async scheduling on the
decode side (received requests joining steps scheduled ahead), with the prefill engine scheduled
ahead, and preemption there; a decode process killed
mid-transfer ends the handed-off requests with an error within the bound, and one stopped halfway
through writing its first outputs is failed as hung within the bound, every request ended and the
pair closed within its bound."""
from __future__ import annotations

import multiprocessing
import signal
import time

import pytest
import torch
from disagg_helpers import SignalAtFirstHandOff, pipeline_breaks
from disagg_pipe_helpers import stopping_at

from engine.disagg import decode_client
from engine.disagg.config import DisaggregationConfig
from engine.disagg.kv_transfer import RECV_RANK, SEND_RANK, KVLink, join_store, open_store
from engine.disagg.link_warmup import warm_recv, warm_send
from engine.disagg.pd_engine import JOIN_TIMEOUT_S, DisaggregatedEngine
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from policies.request import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPTS = [list(range(1, 1 + n)) for n in (5, 40, 130, 300, 17, 64)]
ARGS = {"model": "qwen3-0.6b", "max_model_len": 1024, "max_num_seqs": 8, "max_num_batched_tokens": 1024,
        "gpu_memory_utilization": 0.5}
TIMEOUT_S = 20.0


def _generate(engine, prompts=PROMPTS, params=GREEDY, on_step=None) -> list:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done, deadline = {}, time.monotonic() + 300
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not end within 300 s"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    return [done[f"r{i}"] for i in range(len(prompts))]


def _agree(a, b, label: str) -> float:
    a = [o.outputs[0].token_ids for o in a]
    b = [o.outputs[0].token_ids for o in b]
    exact = sum(x == y for x, y in zip(a, b))
    first8 = sum(x[:8] == y[:8] for x, y in zip(a, b))
    print(f"\n[agreement] {label}: {exact}/{len(a)} sequences identical over {len(a[0])} tokens, "
          f"{first8}/{len(a)} on their first 8")
    return first8 / len(a)


def _receiver(port: int, blocks: list[int], result) -> None:
    torch.cuda.set_device(1)
    k = [torch.zeros(16, 16, 8, 128, dtype=torch.bfloat16, device="cuda:1") for _ in range(4)]
    v = [torch.zeros_like(x) for x in k]
    link = KVLink(RECV_RANK, join_store(port, 30.0), "cuda:1", 30.0)
    transfer = link.recv([("a", blocks[:1]), ("b", blocks[1:])], k)
    done = link.wait_all(30.0)
    assert done and done[0].error is None, done
    link.scatter(transfer, k, v)
    torch.cuda.synchronize()
    result.put([(x.cpu(), y.cpu()) for x, y in zip(k, v)])
    link.close()


def test_link_moves_blocks_between_gpus():
    ctx = multiprocessing.get_context("spawn")
    store, result = open_store(30.0), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(store.port, [9, 2, 5], result), daemon=True)
    proc.start()
    g = torch.Generator(device="cuda:0").manual_seed(0)
    k = [torch.randn(16, 16, 8, 128, generator=g, device="cuda:0").bfloat16() for _ in range(4)]
    v = [torch.randn(16, 16, 8, 128, generator=g, device="cuda:0").bfloat16() for _ in range(4)]
    link = KVLink(SEND_RANK, store, "cuda:0", 30.0)
    link.send([("a", [0]), ("b", [7, 3])], k, v)
    done = link.wait_all(30.0)
    assert done and done[0].error is None
    got = result.get(timeout=60)
    proc.join(10)
    link.close()
    for layer, (rk, rv) in enumerate(got):
        assert torch.equal(rk[[9, 2, 5]], k[layer][[0, 7, 3]].cpu())
        assert torch.equal(rv[[9, 2, 5]], v[layer][[0, 7, 3]].cpu())


def _warm_receiver(port: int, result) -> None:
    torch.cuda.set_device(1)
    g = torch.Generator(device="cuda:1").manual_seed(1)
    k = [torch.randn(16, 16, 8, 128, generator=g, device="cuda:1").bfloat16() for _ in range(4)]
    v = [torch.randn(16, 16, 8, 128, generator=g, device="cuda:1").bfloat16() for _ in range(4)]
    before = [x.cpu() for x in k + v]
    link = KVLink(RECV_RANK, join_store(port, 30.0), "cuda:1", 30.0)
    warm = warm_recv(link, k, v)
    result.put((before, [x.cpu() for x in k + v], warm.num_bytes, link.num_posted))
    link.close()


def test_the_start_up_transfer_leaves_both_caches_as_they_were():
    """One block through the serving path (gather, NCCL send/recv, scatter), the receiver's block
    written back after: no KV block changes on either GPU."""
    ctx = multiprocessing.get_context("spawn")
    store, result = open_store(30.0), ctx.Queue()
    proc = ctx.Process(target=_warm_receiver, args=(store.port, result), daemon=True)
    proc.start()
    g = torch.Generator(device="cuda:0").manual_seed(0)
    k = [torch.randn(16, 16, 8, 128, generator=g, device="cuda:0").bfloat16() for _ in range(4)]
    v = [torch.randn(16, 16, 8, 128, generator=g, device="cuda:0").bfloat16() for _ in range(4)]
    sent_before = [x.clone() for x in k + v]
    link = KVLink(SEND_RANK, store, "cuda:0", 30.0)
    warm = warm_send(link, k, v)
    before, after, peer_bytes, peer_posted = result.get(timeout=60)
    proc.join(10)
    link.close()
    assert warm.num_bytes == peer_bytes == 8 * 16 * 8 * 128 * 2 and link.num_posted == peer_posted == 1
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.equal(a, b) for a, b in zip(sent_before, k + v))


@pytest.fixture(scope="module")
def reference():
    with LLMEngine(EngineArgs(**ARGS)) as engine:  # closed before the pair sizes its KV cache
        return _generate(engine)


def test_pair_bf16_greedy_agrees_with_one_engine(reference):
    with DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=TIMEOUT_S)) as pair:
        assert pair.link.num_posted == 1  # the start-up transfer: the requests' are not the link's first
        print(f"\n[start-up] KV link warm-up {pair.link_warm.seconds * 1e3:.1f} ms, {pair.link_warm.num_bytes} bytes")
        got = _generate(pair)
        rows, steps = pair.decode_rows, pair.decode_steps
    assert _agree(got, reference, "1P+1D vs one engine") >= 5 / 6
    for r in rows:
        print(f"[transfer] {r['request_id']}: prompt {r['prompt_len']} tokens, {r['transfer_bytes']} bytes, "
              f"link {r['link_time'] * 1e3:.2f} ms, transfer {r['transfer_time'] * 1e3:.2f} ms, "
              f"TTFT {r['ttft'] * 1e3:.1f} ms")
    assert all(r["transfer_bytes"] > 0 and r["link_time"] >= 0 for r in rows)
    for s in steps[:5]:
        print(f"[decode step] {s['step']}: t={s['time'] * 1e3:.1f} ms, {s['duration'] * 1e3:.2f} ms, "
              f"{s['num_decode_seqs']} seqs")
    assert steps and all(s["num_decode_seqs"] > 0 for s in steps)


def test_pair_with_its_prefill_scheduled_ahead_agrees_with_one_engine():
    """`prefill_async_scheduling`: hand-offs gathered on the link's stream while the step scheduled
    ahead runs on the compute stream (the gather does not wait for it) carry the right KV."""
    prompts = [list(range(1 + i, 1 + i + n)) for i, n in enumerate((5, 40, 130, 300, 17, 64, 700, 9) * 3)]
    with LLMEngine(EngineArgs(**ARGS)) as engine:
        want = _generate(engine, prompts)
    config = DisaggregationConfig(transfer_timeout_s=TIMEOUT_S, prefill_async_scheduling=True)
    with DisaggregatedEngine(EngineArgs(**ARGS), config) as pair:
        got = _generate(pair, prompts)
        ahead = pair.prefill.scheduler.num_scheduled_ahead
    print(f"\n[ahead] {ahead} prefill steps scheduled ahead")
    assert ahead > 0
    assert _agree(got, want, "1P+1D, prefill scheduled ahead, vs one engine") >= 5 / 6


def test_pair_joining_received_requests_ahead_agrees_with_one_engine():
    """`join_ahead`: a request received while a decode step runs joins the step scheduled after it,
    launched before that step's tokens are known; its first decode reads the KV scattered into its
    blocks on the compute stream between the two (no host sync), and no join breaks the pipeline."""
    prompts = [list(range(1 + i, 1 + i + n)) for i, n in enumerate((5, 40, 130, 300, 17, 64, 700, 9) * 3)]
    with LLMEngine(EngineArgs(**ARGS)) as engine:
        want = _generate(engine, prompts)
    with DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=TIMEOUT_S)) as pair:
        got = _generate(pair, prompts)
        joins, breaks = pipeline_breaks(pair.decode_steps)
    print(f"\n[join ahead] {joins} joins while decoding, {breaks} decode steps not scheduled ahead after them")
    assert breaks == 0
    assert _agree(got, want, "1P+1D, received requests joining ahead, vs one engine") >= 5 / 6


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_pair_preemption_on_the_decode_side_keeps_tokens(mode, reference):
    squeeze = {"max_model_len": 512, "num_gpu_blocks": 32, "preemption_mode": mode}  # blocks of 16 tokens
    config = DisaggregationConfig(transfer_timeout_s=TIMEOUT_S, decode_args=squeeze)
    with DisaggregatedEngine(EngineArgs(**ARGS), config) as pair:
        got = _generate(pair)
        preempted = sum(r["num_preemptions"] for r in pair.decode_rows)
    assert preempted > 0
    assert _agree(got, reference, f"1P+1D, {preempted} preemptions by {mode} on the decode side") >= 5 / 6


def test_pair_killed_decode_process_ends_requests_with_an_error():
    pair = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=TIMEOUT_S))
    kill = SignalAtFirstHandOff(signal.SIGKILL)
    try:
        outs = _generate(pair, on_step=kill)
        assert kill.sent_at and time.monotonic() - kill.sent_at[0] < TIMEOUT_S + 5
        errors = [o for o in outs if o.error is not None]
        assert errors and all(o.outputs[0].finish_reason == "abort:error" for o in errors)
    finally:
        start = time.monotonic()
        pair.close()
        assert time.monotonic() - start < JOIN_TIMEOUT_S + 5


def test_pair_decode_process_stopped_mid_message_ends_requests_with_an_error(monkeypatch):
    monkeypatch.setattr(decode_client, "decode_main", stopping_at("DecodeStep"))
    pair = DisaggregatedEngine(EngineArgs(**ARGS), DisaggregationConfig(transfer_timeout_s=TIMEOUT_S))
    try:
        start = time.monotonic()
        outs = _generate(pair)
        assert time.monotonic() - start < 2 * TIMEOUT_S + 30
        assert all(o.outputs[0].finish_reason == "abort:error" for o in outs)
        assert all(f"the decode engine is hung (pid {pair.decode_pid})" in o.error for o in outs)
        assert all("still incomplete (it stopped writing mid-message)" in o.error for o in outs)
    finally:
        start = time.monotonic()
        pair.close()
        assert time.monotonic() - start < JOIN_TIMEOUT_S + 5
