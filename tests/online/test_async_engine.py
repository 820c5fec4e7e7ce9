"""AsyncLLMEngine on CPU with a tiny model: streams equal to LLM.generate (cumulative and delta, both
scheduling modes), consumers that leave abort their request and free its blocks, one bad request
fails alone, a dead loop fails every stream, the waiting cap refuses at once, the loop sleeps when
idle, and the stats count what ran."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
from engine_helpers import ragged_prompts, save_tiny_model
from hypothesis import given
from hypothesis import strategies as st

from engine.engine_args import EngineArgs
from engine.offline.llm import LLM
from engine.offline.llm_engine import LLMEngine
from engine.online.async_llm_engine import AsyncLLMEngine, EngineDeadError, EngineQueueFullError
from policies.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("async") / "qwen3"
    save_tiny_model(path, "qwen3", seed=5)
    return str(path)


def _args(path: str, ahead: bool = False, **kw) -> EngineArgs:
    return EngineArgs(model=path, num_gpu_blocks=96, swap_space=0.01, max_model_len=256, block_size=8,
                      async_scheduling=ahead, **kw)


@pytest.fixture(scope="module")
def reference(tiny):
    """LLM.generate's greedy outputs of the prompts every test uses."""
    prompts = ragged_prompts(8, seed=11, max_len=40)
    return prompts, LLM(tiny, num_gpu_blocks=96, swap_space=0.01, max_model_len=256).generate(
        prompts, GREEDY, use_tqdm=False)


async def _collect(engine: AsyncLLMEngine, prompt, request_id: str, params=GREEDY, **kw) -> list:
    return [out async for out in engine.generate(prompt, params, request_id, **kw)]


def _clean(engine: AsyncLLMEngine) -> None:
    """No request left, no block leaked, the scheduler's invariants hold."""
    inner = engine.engine
    assert not inner.has_unfinished_requests()
    inner.scheduler.check_invariants()
    assert inner.scheduler.block_manager.usage().gpu_used == 0


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_streams_match_llm_generate(tiny, reference, ahead, kind):
    prompts, expected = reference

    async def main():
        engine = AsyncLLMEngine(LLMEngine(_args(tiny, ahead)))
        streams = await asyncio.gather(*(_collect(engine, p, f"r{i}", output_kind=kind)
                                         for i, p in enumerate(prompts)))
        _clean(engine)
        await engine.shutdown()
        return streams

    for stream, want in zip(asyncio.run(main()), expected):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        assert len(stream) == 12  # one output per step that brought a token
        if kind == "cumulative":
            assert [len(o.outputs[0].token_ids) for o in stream] == list(range(1, 13))
            tokens, text = stream[-1].outputs[0].token_ids, stream[-1].outputs[0].text
        else:
            assert all(len(o.outputs[0].token_ids) == 1 for o in stream)
            tokens = [t for o in stream for t in o.outputs[0].token_ids]
            text = "".join(o.outputs[0].text for o in stream)
        assert tokens == want.outputs[0].token_ids
        assert text == want.outputs[0].text
        assert stream[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_consumers_that_leave_abort_and_free_their_blocks(tiny, reference, ahead):
    """A third of 24 concurrent streams stop after a random number of outputs (break, or their task
    is cancelled): each is aborted within a step or two (the one in flight, and with async scheduling
    the one launched ahead), every block comes back, the rest are exact."""
    prompts, expected = reference
    rng = random.Random(3)
    plan = [(i % len(prompts), rng.choice(["break", "cancel"]) if i % 3 == 0 else None, rng.randint(1, 6))
            for i in range(24)]

    async def main():
        engine = AsyncLLMEngine(LLMEngine(_args(tiny, ahead)))
        got, ended = {}, {}
        engine.add_finished_observer(lambda r: ended.setdefault(r.request_id, r))

        async def client(i, p, how, after):
            outs = []
            async for out in engine.generate(prompts[p], GREEDY, f"c{i}"):
                outs.append(out)
                if how == "break" and len(outs) == after:
                    break
                if how == "cancel" and len(outs) == after:
                    asyncio.current_task().cancel()
                    await asyncio.sleep(0)
            got[i] = outs

        tasks = [asyncio.create_task(client(i, p, how, after)) for i, (p, how, after) in enumerate(plan)]
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(20):  # the aborts reach the scheduler at the next step
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        _clean(engine)
        await engine.shutdown()
        return got, ended

    got, ended = asyncio.run(main())
    for i, (p, how, after) in enumerate(plan):
        if how is None:
            assert ended[f"c{i}"].finish_reason == "length"
        else:
            assert ended[f"c{i}"].finish_reason == "abort:user"
            assert ended[f"c{i}"].num_generation_tokens <= after + 2
        if how is None:
            assert got[i][-1].finished and got[i][-1].outputs[0].token_ids == expected[p].outputs[0].token_ids
        elif how == "break":
            assert len(got[i]) == after and not got[i][-1].finished
        else:
            assert i not in got  # the task was cancelled


def test_a_bad_request_fails_alone_and_the_loop_goes_on(tiny, reference):
    prompts, expected = reference

    async def main():
        engine = AsyncLLMEngine(LLMEngine(_args(tiny)))
        good = asyncio.create_task(_collect(engine, prompts[0], "good"))
        with pytest.raises(ValueError, match="prompt_token_ids.*max_model_len=256"):
            await _collect(engine, [1] * 300, "too-long")
        with pytest.raises(ValueError, match=r"prompt_token_ids.*\[0, 256\)"):
            await _collect(engine, [1, 999], "bad-token")
        with pytest.raises(ValueError, match="request_id"):
            await _collect(engine, [1, 2], "")
        with pytest.raises(ValueError, match="prompt="):
            await _collect(engine, {"text": "x"}, "bad-dict")
        with pytest.raises(ValueError, match="output_kind"):
            await _collect(engine, [1, 2], "kind", output_kind="final_only")
        outs = await good
        assert outs[-1].outputs[0].token_ids == expected[0].outputs[0].token_ids
        text = await _collect(engine, {"prompt_token_ids": prompts[1]}, "dict")
        assert text[-1].outputs[0].token_ids == expected[1].outputs[0].token_ids
        assert engine.is_running and not engine.errored
        await engine.check_health()
        await engine.shutdown()

    asyncio.run(main())


def test_a_dead_loop_fails_every_stream_and_health(tiny, reference, monkeypatch):
    prompts, _ = reference

    async def main():
        inner = LLMEngine(_args(tiny))
        engine = AsyncLLMEngine(inner)
        calls = {"n": 0}
        step = inner.step

        def broken_step():
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("device lost")
            return step()

        monkeypatch.setattr(inner, "step", broken_step)
        results = await asyncio.wait_for(asyncio.gather(
            *(_collect(engine, p, f"r{i}") for i, p in enumerate(prompts[:4])), return_exceptions=True), 30)
        assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results)
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(engine, prompts[0], "after")
        await engine.shutdown()

    asyncio.run(main())


def test_waiting_cap_refuses_at_once(tiny, reference):
    prompts, expected = reference

    async def main():
        engine = AsyncLLMEngine(LLMEngine(_args(tiny)), max_waiting_requests=2)
        first = [engine.generate(p, GREEDY, f"r{i}") for i, p in enumerate(prompts[:2])]
        firsts = [asyncio.create_task(g.__anext__()) for g in first]
        await asyncio.sleep(0)  # both queued, none stepped yet
        with pytest.raises(EngineQueueFullError, match="max_waiting_requests"):
            await _collect(engine, prompts[2], "refused")
        await asyncio.gather(*firsts)
        for g in first:
            async for _ in g:
                pass
        # Served later once the queue drained.
        outs = await _collect(engine, prompts[2], "later")
        assert outs[-1].outputs[0].token_ids == expected[2].outputs[0].token_ids
        await engine.shutdown()

    asyncio.run(main())
    with pytest.raises(ValueError, match="max_waiting_requests"):
        AsyncLLMEngine(object(), max_waiting_requests=0)


def test_idle_loop_sleeps_and_stats_count(tiny, reference):
    prompts, _ = reference

    async def main():
        inner = LLMEngine(_args(tiny))
        engine = AsyncLLMEngine(inner)
        finished = []
        engine.add_finished_observer(finished.append)
        await asyncio.gather(*(_collect(engine, p, f"r{i}") for i, p in enumerate(prompts[:3])))
        stats = engine.stats()
        steps = stats.num_steps_total
        await asyncio.sleep(0.3)  # idle: no step runs
        assert engine.stats().num_steps_total == steps and engine.is_running
        assert stats.generation_tokens_total == 3 * 12
        assert stats.prompt_tokens_total == sum(len(p) for p in prompts[:3])
        assert stats.num_requests_finished_total == 3 and stats.num_running == stats.num_waiting == 0
        assert sorted(r.request_id for r in finished) == ["r0", "r1", "r2"]
        for r in finished:
            assert r.num_generation_tokens == 12 and r.finish_reason == "length"
            assert len(r.inter_token_latencies) == 11 and 0 < r.ttft <= r.e2e
        assert inner.recorder.steps == [] and inner.recorder.requests == []  # no trace kept
        await engine.shutdown()

        kept = AsyncLLMEngine(LLMEngine(_args(tiny)), keep_trace=True)
        await _collect(kept, prompts[0], "kept")
        assert [r["request_id"] for r in kept.engine.recorder.requests] == ["kept"]
        assert len(kept.engine.recorder.steps) == kept.stats().num_steps_total == 12
        await kept.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize(("policy", "block_manager", "preemption_mode", "ahead"), [
    ("fcfs", "paged", "recompute", False), ("priority", "prefix", "swap", True),
    ("fcfs", "contiguous", "recompute", True), ("priority", "paged", "swap", False),
    ("srpt", "paged", "recompute", True), ("mlfq", "prefix", "swap", False), ("vtc", "paged", "recompute", True),
    ("sjf", "contiguous", "swap", True)])
def test_every_policy_and_block_manager_under_preemption(tiny, reference, policy, block_manager,
                                                         preemption_mode, ahead):
    """24 streams with mixed priorities and three tenants over a KV pool that holds a few of them
    (preemptions), a third of the clients leaving early: the others get LLM.generate's tokens, no block leaks."""
    prompts, expected = reference
    rng = random.Random(policy + block_manager)

    async def main():
        engine = AsyncLLMEngine(LLMEngine(EngineArgs(
            model=tiny, num_gpu_blocks=24, swap_space=0.01, max_model_len=128, block_size=8,
            async_scheduling=ahead, policy=policy, block_manager=block_manager, preemption_mode=preemption_mode)))

        async def client(i):
            outs = []
            async for out in engine.generate(prompts[i % len(prompts)], GREEDY, f"c{i}", priority=rng.randint(0, 3),
                                             tenant=f"t{i % 3}"):
                outs.append(out)
                if i % 3 == 0 and len(outs) == 1 + i % 5:
                    break
            return outs

        got = await asyncio.gather(*(client(i) for i in range(24)))
        for _ in range(40):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        _clean(engine)
        stats = engine.stats()
        await engine.shutdown()
        return got, stats

    got, stats = asyncio.run(main())
    # The contiguous manager reserves a request's whole length at admission: it queues, never preempts.
    assert (stats.num_preemptions_total > 0) is (block_manager != "contiguous")
    for i, outs in enumerate(got):
        if i % 3:
            assert outs[-1].finished and outs[-1].outputs[0].token_ids == expected[i % len(prompts)].outputs[0].token_ids


@given(st.lists(st.tuples(st.integers(0, 2), st.text(max_size=3), st.lists(st.integers(0, 9), max_size=2),
                          st.booleans()), min_size=1, max_size=12),
       st.lists(st.booleans(), min_size=12, max_size=12))
def test_a_slow_reader_gets_the_deltas_merged(deltas, reads):
    """Deltas put while the reader is busy come out as one: per sample, the texts, token ids and
    logprobs of every delta concatenated, whatever the reader's timing."""
    from engine.offline.outputs import CompletionOutput, RequestOutput
    from engine.online.async_stream import RequestStream

    async def main():
        stream, got = RequestStream("r", delta=True), []
        for k, (index, text, tokens, read) in enumerate(deltas):
            last = k == len(deltas) - 1
            stream.put(RequestOutput("r", None, [1], [CompletionOutput(index, text, tokens, "stop" if last else None,
                                                                       logprobs=[{t: -1.0} for t in tokens])],
                                     finished=last))
            if read and reads[k]:
                got.append(await stream.get())
        if not got or not got[-1].finished:
            got.append(await stream.get())
        return got

    got = asyncio.run(main())
    assert [o.finished for o in got] == [False] * (len(got) - 1) + [True]
    for index in range(3):
        want = [d for d in deltas if d[0] == index]
        pieces = [c for o in got for c in o.outputs if c.index == index]
        assert "".join(c.text for c in pieces) == "".join(d[1] for d in want)
        assert [t for c in pieces for t in c.token_ids] == [t for d in want for t in d[2]]
        assert [lp for c in pieces for lp in c.logprobs] == [{t: -1.0} for d in want for t in d[2]]


def test_one_engine_across_event_loops_and_a_failing_observer(tiny, reference):
    """An event loop that ends with a stream open (asyncio.run returning mid-request) leaves the engine
    usable from the next loop, which aborts the orphaned request; an observer that raises is logged
    and serving goes on."""
    prompts, expected = reference
    engine = AsyncLLMEngine(LLMEngine(_args(tiny)))

    def broken(record):
        raise RuntimeError("metrics bug")

    engine.add_finished_observer(broken)

    async def leave_open():
        gen = engine.generate(prompts[0], dataclasses.replace(GREEDY, max_tokens=200), "orphan")
        await gen.__anext__()  # the loop ends here with the stream open

    asyncio.run(leave_open())

    async def again():
        outs = await asyncio.wait_for(_collect(engine, prompts[1], "next"), 60)
        for _ in range(20):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        _clean(engine)
        await engine.shutdown()
        return outs

    outs = asyncio.run(again())
    assert outs[-1].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert engine.stats().num_requests_finished_total == 2  # the orphan (aborted) and "next"


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_parallel_samples_stream_and_abort_ends_the_stream(tiny, reference, ahead):
    """n=3 seeded samples in delta mode join to the cumulative stream's final samples; abort() ends a
    running stream with a final "abort:user" output and frees its blocks."""
    prompts, _ = reference
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=10, ignore_eos=True, logprobs=1)

    async def main():
        engine = AsyncLLMEngine(LLMEngine(_args(tiny, ahead)))
        cumulative = await _collect(engine, prompts[2], "cum", params)
        deltas = await _collect(engine, prompts[2], "delta", params, output_kind="delta")
        long = dataclasses.replace(GREEDY, max_tokens=200)
        outs = []
        async for out in engine.generate(prompts[3], long, "aborted"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("aborted")
        _clean(engine)
        await engine.shutdown()
        return cumulative, deltas, outs

    cumulative, deltas, outs = asyncio.run(main())
    final = {c.index: c for c in cumulative[-1].outputs}
    assert sorted(final) == [0, 1, 2] and len({tuple(c.token_ids) for c in final.values()}) > 1
    for index, c in final.items():
        pieces = [p for o in deltas for p in o.outputs if p.index == index]
        assert [t for p in pieces for t in p.token_ids] == c.token_ids
        assert "".join(p.text for p in pieces) == c.text
        assert [lp for p in pieces for lp in p.logprobs] == c.logprobs and len(c.logprobs) == 10
        assert pieces[-1].finish_reason == "length"
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort:user"
    assert 2 <= len(outs[-1].outputs[0].token_ids) <= 4 and len(outs) <= 4


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_streams_on_the_gpu_match_llm_generate(tiny, ahead):
    """On CUDA with graphs: 64 delta streams (a third leaving early) from the worker thread give
    LLM.generate's tokens on the same engine, and every block comes back.
        python -m pytest -q -m gpu tests/online/test_async_engine.py"""
    prompts = ragged_prompts(64, seed=13, max_len=60)
    inner = LLMEngine(EngineArgs(model=tiny, device="cuda", dtype="float32", num_gpu_blocks=512,
                                 max_model_len=256, block_size=16, async_scheduling=ahead))
    expected = [o.outputs[0].token_ids for o in LLM.from_engine(inner).generate(prompts, GREEDY, use_tqdm=False)]

    async def main():
        engine = AsyncLLMEngine(inner)

        async def client(i):
            tokens = []
            async for out in engine.generate(prompts[i], GREEDY, f"g{i}", output_kind="delta"):
                tokens += out.outputs[0].token_ids if out.outputs else []
                if i % 3 == 0 and len(tokens) >= 3:
                    break
            return tokens

        got = await asyncio.gather(*(client(i) for i in range(64)))
        for _ in range(40):
            if not inner.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        _clean(engine)
        await engine.shutdown()
        return got

    for i, tokens in enumerate(asyncio.run(main())):
        assert tokens == (expected[i][:len(tokens)] if i % 3 == 0 else expected[i])
