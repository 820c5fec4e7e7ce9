"""A decode process that stops on its pipe, for the disaggregated pair's fault tests: the real one
(engine/disagg/decode_process.py) whose end of the pipe stops its process (SIGSTOP) at the first
message of a kind it writes, after writing only part of it (a decode process stopped or stuck
mid-write), or at the first of a kind it reads (before acting on it). Given to `DecodeClient` as
`decode_client.decode_main` (the spawned process imports it from here by name)."""
from __future__ import annotations

import functools
import os
import signal
import struct
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from engine.disagg.decode_process import decode_main
from engine.disagg.messages import DecodeStep


class StopAtMessage:
    def __init__(self, conn: Connection, kind: str, mid_write: bool) -> None:
        """`kind`: the message's class name (a `DecodeStep` counts once it carries outputs);
        `mid_write`: stop while writing one (else as one is read)."""
        self._conn, self._kind, self._mid_write = conn, kind, mid_write
        self.stopped = False

    def _due(self, message: object) -> bool:
        if self.stopped or type(message).__name__ != self._kind:
            return False
        return not isinstance(message, DecodeStep) or bool(message.outputs)

    def send(self, message: object) -> None:
        if not (self._mid_write and self._due(message)):
            self._conn.send(message)
            return
        self.stopped = True
        data = bytes(ForkingPickler.dumps(message))
        write_begun(self._conn, data, len(data) // 2)
        os.kill(os.getpid(), signal.SIGSTOP)
        write_rest(self._conn, data, len(data) // 2)  # continued (SIGCONT): the message is whole

    def recv(self) -> object:
        message = self._conn.recv()
        if not self._mid_write and self._due(message):
            self.stopped = True
            os.kill(os.getpid(), signal.SIGSTOP)
        return message

    def __getattr__(self, name: str):
        return getattr(self._conn, name)


def write_begun(conn: Connection, data: bytes, upto: int) -> None:
    """The start of `data` as `conn.send_bytes(data)` writes it (its length, then its bytes), up to
    byte `upto` of `data`: a writer stopped mid-message."""
    _write(conn.fileno(), struct.pack("!i", len(data)) + data[:upto])


def write_rest(conn: Connection, data: bytes, upto: int) -> None:
    """The rest of a message `write_begun` began."""
    _write(conn.fileno(), data[upto:])


def _write(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def decode_main_stopping(kind: str, mid_write: bool, args, config, port: int, conn: Connection,
                         keep_steps: bool = True) -> None:
    decode_main(args, config, port, StopAtMessage(conn, kind, mid_write), keep_steps)


def stopping_at(kind: str, mid_write: bool = True):
    """A `decode_main` that stops at the first `kind` message (picklable: the process is spawned)."""
    return functools.partial(decode_main_stopping, kind, mid_write)
