"""`PipeReceiver`: the front's reads of the decode process's pipe, made by a thread of their own so
the front's loop never blocks on them.

`Connection.poll` says only that some bytes are readable; `recv` then blocks until the whole
message has come, with no timeout (a partly read message cannot be put back). A writer stopped
(SIGSTOP, a hang) or stuck mid-message would hold the reader in `recv` for good, and every check
the reader's loop makes with it. So one daemon thread does the blocking reads: it waits for a
message's first bytes, notes when they came, reads the message whole (`recv_bytes`, the wire
format `send` writes) and queues its bytes. The caller's `poll` and `recv` mirror `Connection`'s
without blocking: `poll` waits at most its timeout for a message to be whole, `recv` returns one
that is (unpickled on the caller's thread, as `Connection.recv` does). `incomplete` tells how long
a message begun has stayed unfinished (`unfinished`: in words), which bounds the wait (the front
fails a decode engine whose message stays incomplete longer than `transfer_timeout_s`).

The counterpart of `PipeSender` (engine/disagg/pipe_sender.py), which does the same for the
front's writes: the two threads share the one duplex `Connection`, one reading it, one writing it.
The queue is not bounded: the decode process sends at most one step's outputs per decode step,
and the front takes every whole message at each of its steps.

The thread ends at the first read error, kept in `error`: the end of file once the writer's end is
closed (its process ended or was killed), mid-message or not. `poll` is then True and `recv`, once
the messages before it are taken, raises EOFError, as `Connection`'s do at the end of file. A read
blocked on a stopped writer ends when the writer's process is killed (`decode_client._stop` does,
within `JOIN_TIMEOUT_S`); the thread is a daemon, so it never holds the process at exit.
"""
from __future__ import annotations

import select
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler


class PipeReceiver:
    def __init__(self, conn: Connection, name: str) -> None:
        """Reads `conn` from a daemon thread called `name`; `conn` is read by nothing else."""
        self._conn = conn
        # whole messages, pickled, in the order they came, each with when its first bytes came
        self._queue: deque[tuple[float, bytes]] = deque()
        # `time.monotonic()` when the thread saw the first bytes of the message `recv` gave last
        # (once it had the interpreter lock again): experiments/lib/answer_timing.py splits a wait
        # with it
        self.last_arrival: float | None = None
        self._changed = threading.Condition()
        self._begun: float | None = None  # when the first bytes of the message being read came
        self.error: BaseException | None = None  # the read that failed; nothing is read after it
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def poll(self, timeout_s: float = 0.0, arriving_s: float = 0.0) -> bool:
        """True once a message is whole, or the thread has ended (`recv` then raises); waits up to
        `timeout_s` for either, and up to `arriving_s` (when longer) if a message's bytes have come
        and the thread has not queued it yet. The thread needs the interpreter lock to read, which a
        caller busy in Python holds for up to the switch interval (5 ms): without that wait, a
        message that came while the caller worked is seen one caller turn later (the pair's front
        posting a send one prefill step late, docs/disaggregation-measured.md)."""
        def whole() -> bool:
            return bool(self._queue) or self.error is not None

        with self._changed:
            if self._changed.wait_for(whole, timeout_s):
                return True
            if arriving_s <= timeout_s or not self._arriving():
                return False
            return self._changed.wait_for(whole, arriving_s - timeout_s)

    def recv(self) -> object:
        """The oldest whole message, unpickled; never waits. EOFError once the messages before the
        thread's read error are taken (the writer is gone); BlockingIOError if none is whole yet."""
        with self._changed:
            if self._queue:
                self.last_arrival, data = self._queue.popleft()
            elif self.error is not None:
                raise EOFError(f"the pipe's writer is gone: {self.error!r}") from self.error
            else:
                raise BlockingIOError("no whole message from the pipe yet (recv after poll returned True)")
        return ForkingPickler.loads(data)

    def _arriving(self) -> bool:
        """A message is on its way in: its bytes are readable, or the thread is reading it (begun
        within the last second: a writer stopped mid-message is `incomplete`'s, not waited for)."""
        if self._begun is not None:
            return time.monotonic() - self._begun < 1.0
        try:
            return bool(select.select([self._conn.fileno()], [], [], 0)[0])
        except (OSError, ValueError):  # closed: the thread's read reports it
            return False

    def incomplete(self) -> float:
        """Seconds since the first bytes of a message not yet whole came (0.0: none begun)."""
        with self._changed:
            return 0.0 if self._begun is None else time.monotonic() - self._begun

    def unfinished(self) -> str:
        """'' or, if a message is begun and not whole, what the caller sees, in words."""
        begun = self.incomplete()
        if not begun:
            return ""
        return f"a message from it begun {begun:.1f} s ago still incomplete (it stopped writing mid-message)"

    def close(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the thread to end (it ends when the writer's end is closed:
        close that first); False if it is still reading."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        """Its thread has not ended (it ends on the first read error, the end of file included)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                self._conn.poll(None)  # the next message's first bytes, or the end of file
                begun = time.monotonic()
                with self._changed:
                    self._begun = begun
                data = self._conn.recv_bytes()
                with self._changed:
                    self._queue.append((begun, data))
                    self._begun = None
                    self._changed.notify_all()
        except Exception as e:  # noqa: BLE001 (kept for the caller: the writer is gone)
            with self._changed:
                self.error = e
                self._begun = None
                self._changed.notify_all()
