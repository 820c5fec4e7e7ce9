"""`PipeSender`: the front's writes to the decode process's pipe, made by a thread of their own so
the front's loop never blocks on them.

`Connection.send` blocks while the pipe's socket buffer is full, i.e. while the reader is not
reading (a long step, a hang, a stopped process), and has no timeout or non-blocking mode (a
partly written message cannot be taken back). So `send` pickles the message on the caller's thread
(its contents are those at the call, as a direct `conn.send`'s, and a message that cannot be
pickled fails there) and queues the bytes; one daemon thread writes them with `send_bytes` in
order (the wire format `recv` reads). This is the design of the standard library's
`multiprocessing.Queue` (a feeder thread behind a buffer), kept here because the pair's pipe is
one duplex `Connection` read on the front's thread, and because the front needs what a `Queue`
does not tell: how many messages wait unsent and for how long (`backlog`), which bounds the wait
(the front fails a decode engine whose messages wait longer than `transfer_timeout_s`). A
`ThreadPoolExecutor` would do the ordering but joins its worker at the interpreter's exit, where a
worker blocked on a hung reader would keep the process from exiting; this thread is a daemon.

A message goes out at once, from the caller's thread, when nothing is queued before it and the
socket takes it without waiting (`send` with `MSG_DONTWAIT` on the duplex pipe's Unix socket, in
`Connection`'s wire format: a 4-byte length, then the bytes); what the socket does not take is
queued for the thread as raw bytes, ahead of any later message. Without that, a message waited for
the thread to get the interpreter lock, which a caller busy in Python holds for up to the switch
interval (5 ms): the pair's front queued each step's hand-offs at the start of its host time
between prefill steps, and they left only when its next step's GPU wait released the lock, ~2.5 ms
later on the H200 host (the decode side's wait for hand-offs, docs/disaggregation-measured.md). A
pipe that is not a socket (a one-way `os.pipe`) always goes through the thread.

The thread ends after `close` once the messages before it are written, or on the first write
error (the reader's end closed: its process ended or was killed), which it keeps in `error`; the
messages after a failed write are dropped. A write blocked on a stopped reader ends when the
reader's process is killed (`decode_client._stop` does, within `JOIN_TIMEOUT_S`).
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

_END = object()  # queued by `close`: the thread ends when it reaches it


class _Rest(bytes):
    """The part of a message the socket did not take at once: written as it is, no header."""


def _frame(data) -> bytes:
    """`Connection.send_bytes`' wire format: the length (4 bytes, big-endian; -1 and 8 more past
    2 GiB), then the bytes."""
    n = len(data)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!i", -1) + struct.pack("!Q", n)
    return header + bytes(data)


def _socket_of(conn: Connection) -> socket.socket | None:
    """A socket on `conn`'s descriptor (a duplicate, closed with the sender), or None if it is not one."""
    fd = os.dup(conn.fileno())
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return None
    if sock.family != socket.AF_UNIX:
        sock.close()
        return None
    return sock


class PipeSender:
    def __init__(self, conn: Connection, name: str, direct: bool = True) -> None:
        """Writes to `conn` from a daemon thread called `name`, and from the caller's thread when
        nothing waits (`direct`; False: always the thread); `conn` is written by nothing else."""
        self._conn = conn
        self._sock = _socket_of(conn) if direct else None  # None: every message through the thread
        self._queue: deque[tuple[float, object]] = deque()  # (when queued, pickled message or _END)
        self._changed = threading.Condition()
        self._closed = False
        self.error: BaseException | None = None  # the write that failed; nothing is written after it
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, message: object) -> None:
        """Queue `message` (pickled now) behind those before it; never waits for the reader. An
        OSError if an earlier write failed (the reader is gone) or the sender is closed."""
        data = ForkingPickler.dumps(message)  # a view of its own buffer: never changed after
        with self._changed:
            if self.error is not None:
                raise OSError(f"the pipe's reader is gone: {self.error}") from self.error
            if self._closed:
                raise OSError("the pipe's sender is closed")
            if not self._queue and self._sock is not None:  # nothing before it, the thread idle
                frame = _frame(data)
                try:
                    sent = self._sock.send(frame, socket.MSG_DONTWAIT)
                except OSError:  # full (BlockingIOError), or the reader is gone: the thread's write
                    sent = 0  # then waits, or finds the error and keeps it
                if sent == len(frame):
                    return
                if sent:
                    data = _Rest(frame[sent:])
            self._queue.append((time.monotonic(), data))
            self._changed.notify_all()

    def backlog(self) -> tuple[int, float]:
        """(messages not yet written, including one being written; seconds the oldest has waited)."""
        with self._changed:
            waiting = self._waiting()
            return waiting, (time.monotonic() - self._queue[0][0]) if waiting else 0.0

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every queued message to be written; False if some are not
        (the reader is not reading, or a write failed)."""
        with self._changed:
            done = self._changed.wait_for(lambda: not self._waiting() or self.error is not None, timeout_s)
            return done and self.error is None

    def close(self, timeout_s: float) -> bool:
        """No more messages; the thread ends once those queued are written (or a write fails).
        Waits up to `timeout_s` for it; False if it is still writing (blocked on the reader)."""
        with self._changed:
            if not self._closed:
                self._closed = True
                self._queue.append((time.monotonic(), _END))
                self._changed.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        """Its thread has not ended (it ends after `close`, or on a write error)."""
        return self._thread.is_alive()

    def _waiting(self) -> int:
        return len(self._queue) - (1 if self._closed and self._queue else 0)  # _END is last, if queued

    def _run(self) -> None:
        try:
            self._write_all()
        finally:
            if self._sock is not None:
                self._sock.close()

    def _write_all(self) -> None:
        while True:
            with self._changed:
                while not self._queue:
                    self._changed.wait()
                data = self._queue[0][1]  # left queued while written: it counts in the backlog
            if data is _END:
                with self._changed:
                    self._queue.popleft()
                    self._changed.notify_all()
                return
            try:
                if isinstance(data, _Rest):  # a message's tail: its head went out from `send`
                    self._sock.sendall(data)
                else:
                    self._conn.send_bytes(data)
            except Exception as e:  # noqa: BLE001 (kept for the caller: the reader is gone)
                with self._changed:
                    self.error = e
                    self._queue.clear()
                    self._changed.notify_all()
                return
            with self._changed:
                self._queue.popleft()
                self._changed.notify_all()
