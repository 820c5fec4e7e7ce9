"""Messages between the front end and the engine core process over two one-way pipes.

A message is a pickle behind its length (8 bytes, little-endian). The core reads and writes its
ends blocking (`read_message`, `write_message`, `readable`); the front end drives its ends from its
event loop (`LoopChannel`): a write never blocks the loop (what the pipe cannot take at once waits
in a buffer until the loop reports the pipe writable), and messages are read when the loop reports
the pipe readable. No thread stands between the pipe and the event loop, so a message reaches the
streams in the loop iteration that sees it, without a hand-off to another thread. When one read
brings several messages, the first is handed over at once and each next one a loop turn later:
what a message wakes (a first token's stream, which the core sends in a message of its own ahead
of the running streams') runs before the next message is unpickled.
"""
from __future__ import annotations

import asyncio
import os
import pickle
import select
import struct
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct("<Q")
_READ_SIZE = 1 << 20
# What the event loop's side asks of its pipe per read: a Linux pipe's capacity, so no read can
# return more. `os.read(fd, n)` allocates n bytes before it reads: 1 MiB there cost ~12 us a
# message, against ~0.5 us for this.
_LOOP_READ_SIZE = 1 << 16


def frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def write_message(fd: int, message: Any) -> None:
    """Blocking write of one message (the core's side)."""
    view = memoryview(frame(message))
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, _READ_SIZE))
        if not chunk:
            raise EOFError("the pipe closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_message(fd: int, timeout_s: float | None = None) -> Any:
    """Blocking read of one message; TimeoutError if none starts within `timeout_s`, EOFError when
    the other end closed."""
    if timeout_s is not None and not readable(fd, timeout_s):
        raise TimeoutError(f"no message within {timeout_s} s")
    (n,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    return pickle.loads(_read_exactly(fd, n))


def readable(fd: int, timeout_s: float = 0.0) -> bool:
    """A message (or the end of the pipe) is there to read."""
    return bool(select.select([fd], [], [], timeout_s)[0])


class LoopChannel:
    """The front end's two pipe ends, driven by one event loop at a time (`attach`)."""

    def __init__(self, send_fd: int, recv_fd: int) -> None:
        self.send_fd, self.recv_fd = send_fd, recv_fd
        os.set_blocking(send_fd, False)
        os.set_blocking(recv_fd, False)
        self._out = bytearray()  # framed messages the pipe has not taken yet
        self._in = bytearray()  # bytes read and not yet a whole message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_message: Callable[[Any], None] | None = None
        self._on_closed: Callable[[], None] | None = None
        self._next: asyncio.Handle | None = None  # the next whole message's hand-over, a loop turn on
        self.closed = False  # the core's end closed (EOF), or `detach(close=True)`

    def attach(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None],
               on_closed: Callable[[], None]) -> None:
        """Read on `loop` from now on: `on_message(message)` for each message, `on_closed()` once at
        the end of the pipe."""
        self.detach()
        self._loop, self._on_message, self._on_closed = loop, on_message, on_closed
        if not self.closed:
            loop.add_reader(self.recv_fd, self._readable)
            if self._out:
                loop.add_writer(self.send_fd, self._writable)
        if self._in:
            self._next = loop.call_soon(self._deliver)

    def detach(self, close: bool = False) -> None:
        """Stop reading and writing on the loop; `close`: for good, after a last try to write what
        waits (`pending` tells whether some of it is still there)."""
        loop, self._loop = self._loop, None
        if self._next is not None:
            self._next.cancel()
            self._next = None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.recv_fd)
            loop.remove_writer(self.send_fd)
        if close:
            self.closed = True
            if self._out:
                self._writable()

    @property
    def pending(self) -> bool:
        """Bytes wait to be written (the pipe is not at a message boundary)."""
        return bool(self._out)

    def send(self, message: Any) -> None:
        """Queue one message; it leaves now if the pipe takes it. Raises BrokenPipeError when the
        core's end is closed."""
        data = frame(message)
        if self._out:
            self._out += data
            return
        try:
            sent = os.write(self.send_fd, data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._out += data[sent:]
            if self._loop is not None:
                self._loop.add_writer(self.send_fd, self._writable)

    def _writable(self) -> None:
        try:
            sent = os.write(self.send_fd, self._out)
        except BlockingIOError:
            return
        except OSError:  # the core is gone: its end of the other pipe closes too, which reports it
            self._out.clear()
            sent = 0
        del self._out[:sent]
        if not self._out and self._loop is not None:
            self._loop.remove_writer(self.send_fd)

    def _readable(self) -> None:
        while True:
            try:
                chunk = os.read(self.recv_fd, _LOOP_READ_SIZE)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._loop.remove_reader(self.recv_fd)
                self.closed = True
                if self._next is not None:
                    self._next.cancel()
                self._deliver(every=True)
                self._on_closed()
                return
            self._in += chunk
            if len(chunk) < _LOOP_READ_SIZE:
                break
        if self._next is None:  # else the hand-over already due takes the next message
            self._deliver()

    def _deliver(self, every: bool = False) -> None:
        """Hand over the first whole message read, and schedule the next one's for the loop's next
        turn (`every`: all of them now)."""
        self._next = None
        buf, size = self._in, _HEADER.size
        while len(buf) >= size:
            (n,) = _HEADER.unpack_from(buf)
            if len(buf) - size < n:
                return
            with memoryview(buf) as view:
                message = pickle.loads(view[size:size + n])
            del buf[:size + n]
            self._on_message(message)
            if not every and len(buf) >= size and self._loop is not None:
                self._next = self._loop.call_soon(self._deliver)
                return
