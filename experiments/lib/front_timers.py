"""Timers on a disaggregated pair's front (engine/disagg/pd_engine.py), by part: what
`experiments.bench_handoff_host` and `experiments.lab.front_parts` read.

`instrument(engine)` wraps the front's methods on its path (`PARTS`: (owner attribute path, method,
part)) with a `PartTimer`, which keeps each part's exclusive time (nested wrapped calls subtracted)
on the wall clock and on the front thread's CPU clock, and its calls; the front's reads of the pipe
go through `_Reads`, which times its waits apart (`NOT_HOST`: not host work). The timers add ~1-2 us
per wrapped call.
"""
from __future__ import annotations

import time
from collections import defaultdict

from engine.disagg.pd_engine import DisaggregatedEngine


class PartTimer:
    """Exclusive time per part, on the wall clock and on the front thread's CPU clock: a wrapped
    call's time less that of the wrapped calls inside it."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # [wall, cpu] spent in wrapped calls inside it

    def wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            inner = [0.0, 0.0]
            self._stack.append(inner)
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
                self._stack.pop()
                self.wall[part] += wall - inner[0]
                self.cpu[part] += cpu - inner[1]
                self.calls[part] += 1
                if self._stack:
                    self._stack[-1][0] += wall
                    self._stack[-1][1] += cpu

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()


class _Reads:
    """The front's reads of the pipe (its `PipeReceiver`; an older front's `Connection`), its waits
    with a timeout timed apart (the idle front's wait)."""

    def __init__(self, receiver, timer: PartTimer) -> None:
        self._receiver = receiver
        timer.wrap(self, "_wait", "idle wait")
        timer.wrap(self, "_arriving", "arriving wait")

    def _wait(self, timeout: float) -> bool:
        return self._receiver.poll(timeout)

    def _arriving(self, arriving_s: float) -> bool:
        return self._receiver.poll(0, arriving_s)

    def poll(self, timeout: float = 0.0, arriving_s: float = 0.0) -> bool:
        """The front's reads: a wait with a timeout (idle) and the wait for a message on its way in
        (`PipeReceiver.poll`'s `arriving_s`) are timed apart; an older receiver takes no `arriving_s`."""
        if timeout:
            return self._wait(timeout)
        if self._receiver.poll(0):
            return True
        return self._arriving(arriving_s) if arriving_s else False

    def recv(self):
        return self._receiver.recv()

    def __getattr__(self, name: str):
        return getattr(self._receiver, name)


# (owner attribute path on the front, method, part); the order is the table's.
PARTS = (
    ("", "step", "front loop (rest)"),
    ("prefill.scheduler", "schedule", "schedule"),
    ("prefill.runner", "execute", "forward"),
    ("prefill.scheduler", "update", "scheduler update (rest)"),
    ("side", "hand_off", "PrefillSide.hand_off"),
    ("prefill", "step", "prefill step outputs"),
    ("", "_hand_off_all", "front hand-off batch (rest)"),
    ("", "_hand_off", "front _hand_off (rest)"),
    ("prefill", "hand_over_request", "hand_over_request"),
    ("_sender", "send", "pickle + queue message"),
    ("_receiver", "recv", "recv + unpickle"),  # the read itself is the pipe's reader thread's
    ("", "_take_messages", "take messages (rest)"),
    ("", "_start_transfer", "start transfer (rest)"),
    ("link", "send", "KVLink.send"),
    ("", "_finish_transfers", "finish transfers (rest)"),
    ("side", "finish_transfer", "PrefillSide.finish_transfer"),
    ("", "_decode_outputs", "decode outputs"),
    ("", "_check_decode_alive", "check decode alive"),
)
NOT_HOST = ("forward", "idle wait", "arriving wait")
READS = ("recv + unpickle", "take messages (rest)", "decode outputs")  # the decode process's messages read back


def owner_of(engine, path: str):
    """The object at attribute path `path` ("prefill.scheduler"; "": the front itself) of `engine`."""
    owner = engine
    for name in filter(None, path.split(".")):
        owner = getattr(owner, name)
    return owner


def instrument(engine: DisaggregatedEngine) -> PartTimer:
    timer = PartTimer()
    reads = "_receiver" if hasattr(engine, "_receiver") else "_conn"  # an older front read the pipe itself
    engine._receiver = _Reads(getattr(engine, reads), timer)
    setattr(engine, reads, engine._receiver)
    for path, name, part in PARTS:
        owner = owner_of(engine, path)
        if hasattr(owner, name):  # a front without that method (an older tree, for an A/B) skips it
            timer.wrap(owner, name, part)
    return timer
