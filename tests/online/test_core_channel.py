"""The pipe protocol between the front end and the engine core process (engine/online/core_channel.py): the
event loop's side never blocks (a message larger than the pipe waits in a buffer), delivers whole
messages in order however the bytes arrive, reports the end of the pipe once; and a process engine's
front end serves with no thread of its own between the pipe and the event loop."""
from __future__ import annotations

import asyncio
import os
import threading

from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples

from engine.online.core_channel import LoopChannel, frame, read_message, write_message


def _pipes():
    to_core_r, to_core_w = os.pipe()
    from_core_r, from_core_w = os.pipe()
    return to_core_r, to_core_w, from_core_r, from_core_w


def test_a_send_larger_than_the_pipe_never_blocks_the_loop():
    """4 MiB to a core that reads nothing yet: send returns at once, the rest leaves as the core reads."""
    to_core_r, to_core_w, from_core_r, from_core_w = _pipes()
    big = bytes(range(256)) * (4 << 12)

    async def main():
        channel = LoopChannel(to_core_w, from_core_r)
        channel.attach(asyncio.get_running_loop(), lambda m: None, lambda: None)
        channel.send(("big", big))
        channel.send(("after", 1))
        assert channel.pending  # the pipe took only part of it, and the loop goes on
        got = await asyncio.to_thread(lambda: [read_message(to_core_r), read_message(to_core_r)])
        assert got == [("big", big), ("after", 1)]
        assert not channel.pending
        channel.detach(close=True)

    asyncio.run(main())
    for fd in (to_core_r, to_core_w, from_core_r, from_core_w):
        os.close(fd)


@settings(max_examples=examples(25), deadline=None)
@given(st.lists(st.one_of(st.integers(), st.binary(max_size=3000), st.text(max_size=50)), max_size=20),
       st.lists(st.integers(1, 5000), min_size=1, max_size=30))
def test_whole_messages_in_order_however_the_bytes_arrive(messages, cuts):
    """The core's bytes arrive in pieces of any size: each message is delivered once, whole, in
    order; the end of the pipe comes after the last one, once."""
    to_core_r, to_core_w, from_core_r, from_core_w = _pipes()
    data = b"".join(frame(m) for m in messages)

    def core():
        view, i = memoryview(data), 0
        while view:
            n = cuts[i % len(cuts)]
            os.write(from_core_w, view[:n])
            view, i = view[n:], i + 1
        os.close(from_core_w)

    async def main():
        got, ended = [], asyncio.Event()
        channel = LoopChannel(to_core_w, from_core_r)
        channel.attach(asyncio.get_running_loop(), got.append, lambda: (got.append("<end>"), ended.set()))
        writer = threading.Thread(target=core)
        writer.start()
        await asyncio.wait_for(ended.wait(), 10)
        writer.join()
        channel.detach(close=True)
        return got

    assert asyncio.run(main()) == [*messages, "<end>"]
    for fd in (to_core_r, to_core_w, from_core_r):
        os.close(fd)


def test_the_blocking_side_reads_what_it_wrote():
    r, w = os.pipe()
    write_message(w, {"a": [1, 2]})
    write_message(w, None)
    assert read_message(r, timeout_s=1.0) == {"a": [1, 2]}
    assert read_message(r) is None
    os.close(w)
    try:
        read_message(r)
    except EOFError:
        pass
    else:
        raise AssertionError("no EOFError at the end of the pipe")
    os.close(r)


def test_messages_of_one_read_come_a_loop_turn_apart_and_all_before_the_end():
    """What a message's handling schedules runs before the next message of the same read is handed
    over (a first token's stream before the running streams' message is unpickled); at the end of
    the pipe every message is handed over before the end is reported."""
    _, to_core_w, from_core_r, from_core_w = _pipes()

    async def main():
        loop, got, woke, closed, three = asyncio.get_running_loop(), [], [], asyncio.Event(), asyncio.Event()

        def on_message(m):
            got.append((m, list(woke)))
            loop.call_soon(woke.append, m)
            if m == 3:
                three.set()

        channel = LoopChannel(to_core_w, from_core_r)
        channel.attach(loop, on_message, lambda: (got.append(("end", list(woke))), closed.set()))
        os.write(from_core_w, frame(1) + frame(2) + frame(3))
        await asyncio.wait_for(three.wait(), 5)
        os.write(from_core_w, frame(4) + frame(5))
        os.close(from_core_w)
        await asyncio.wait_for(closed.wait(), 5)
        channel.detach(close=True)
        return got

    got = asyncio.run(main())
    assert got[:3] == [(1, []), (2, [1]), (3, [1, 2])]
    assert [m for m, _ in got[3:]] == [4, 5, "end"]


def test_a_process_engine_serves_with_no_front_end_thread():
    """Requests go to the core and outputs come back on the event loop itself: serving starts no
    thread in the front end (a hand-off to a thread waits for it to be scheduled and for the GIL)."""
    from engine.engine_args import EngineArgs
    from engine.online.async_llm_engine import AsyncLLMEngine
    from policies.request import SamplingParams

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model="tiny-llama", num_gpu_blocks=32, max_model_len=64),
                                             engine_process=True)
    before = {t.ident for t in threading.enumerate()}

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

        async def one(i: int) -> list:
            return [o async for o in engine.generate([1, 2, i], params, f"r{i}")]

        outs = await asyncio.gather(*(one(i) for i in range(3)))
        started = [t.name for t in threading.enumerate() if t.ident not in before]
        await engine.shutdown()
        return outs, started

    outs, started = asyncio.run(main())
    assert all(len(o[-1].outputs[0].token_ids) == 4 for o in outs)
    assert started == []


def test_the_loop_side_asks_no_more_than_a_pipe_holds(monkeypatch):
    """Each read allocates what it asks for before it reads: the loop's side asks for at most a
    pipe's capacity (64 KiB), and a larger message still arrives whole."""
    import engine.online.core_channel as core_channel

    asked = []
    read = os.read
    monkeypatch.setattr(core_channel.os, "read", lambda fd, n: asked.append(n) or read(fd, n))
    to_core_r, to_core_w, from_core_r, from_core_w = _pipes()
    big = bytes(range(256)) * 1024  # 256 KiB: several pipefuls

    async def main():
        got, done = [], asyncio.Event()
        channel = LoopChannel(to_core_w, from_core_r)
        channel.attach(asyncio.get_running_loop(), lambda m: (got.append(m), done.set()), lambda: None)
        writer = threading.Thread(target=write_message, args=(from_core_w, ("big", big)))
        writer.start()
        await asyncio.wait_for(done.wait(), 10)
        writer.join()
        channel.detach(close=True)
        return got

    assert asyncio.run(main()) == [("big", big)]
    assert asked and max(asked) <= 1 << 16
    for fd in (to_core_r, to_core_w, from_core_r, from_core_w):
        os.close(fd)
