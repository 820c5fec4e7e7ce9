"""The front's handle on the decode engine's process (engine/disagg/decode_process.py): start it
with the decode engine's arguments, wait (bounded) for each step of its start-up, exchange the
typed messages of engine/disagg/messages.py over one pipe (written by a `PipeSender`,
engine/disagg/pipe_sender.py, so no write waits on the decode loop, and read by a `PipeReceiver`,
engine/disagg/pipe_receiver.py, so no read waits on a message the decode process has begun and not
finished), and stop it within `JOIN_TIMEOUT_S` (also when the handle is dropped without `close`)."""
from __future__ import annotations

import dataclasses
import multiprocessing
import time
import weakref

from engine.disagg.config import DisaggregationConfig
from engine.disagg.decode_process import decode_main
from engine.disagg.messages import DecodeFailed
from engine.disagg.pipe_receiver import PipeReceiver
from engine.disagg.pipe_sender import PipeSender
from engine.engine_args import EngineArgs

JOIN_TIMEOUT_S = 10.0
# Fields that shape a KV block: both engines of a pair share them (a transfer moves blocks as they are).
KV_LAYOUT_FIELDS = ("model", "dtype", "block_size", "tensor_parallel_size")


def decode_engine_args(args: EngineArgs, config: DisaggregationConfig) -> EngineArgs:
    """The decode engine's arguments: the pair's, on its own device, with `decode_args` applied."""
    fixed = sorted(set(config.decode_args or {}) & set(KV_LAYOUT_FIELDS))
    if fixed:
        raise ValueError(f"disaggregation.decode_args may not set {fixed}: the decode engine's KV blocks must have "
                         f"the prefill engine's layout ({', '.join(KV_LAYOUT_FIELDS)})")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    values["device"] = config.decode_device or _next_device(args.resolve_device())
    return EngineArgs.from_dict({**values, **(config.decode_args or {})})


class DecodeClient:
    def __init__(self, args: EngineArgs, config: DisaggregationConfig, port: int, keep_steps: bool = True) -> None:
        """Start the decode process (it builds its engine meanwhile); `port`: the link's store;
        `keep_steps`: it sends its engine's step rows."""
        ctx = multiprocessing.get_context("spawn")
        self.args = args
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=decode_main, args=(args, config, port, theirs, keep_steps), name="servelab-decode",
                                   daemon=True)
        self.process.start()
        theirs.close()
        self.sender = PipeSender(self.conn, "servelab-decode-pipe")  # the only writer of `conn`
        self.receiver = PipeReceiver(self.conn, "servelab-decode-pipe-reader")  # its only reader
        self._finalizer = weakref.finalize(self, _stop, self.process, self.conn, self.sender, self.receiver)

    def await_message(self, kind: type, timeout_s: float, doing: str, bound: str):
        """Its next message, which must be a `kind` (`DecodeStarted`, `DecodeReady`): RuntimeError with
        its own error if it failed, or if its process ended, TimeoutError past `timeout_s` (`bound`
        names the setting, and a message of it begun and unfinished); the errors say what it was
        `doing`. A process that died is seen within 0.1 s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.receiver.poll(0.1):
                try:
                    message = self.receiver.recv()
                except EOFError:
                    break
                if isinstance(message, kind):
                    return message
                if isinstance(message, DecodeFailed):
                    raise RuntimeError(f"the decode engine failed while {doing}:\n{message.error}")
                raise RuntimeError(f"the decode engine sent {type(message).__name__} while {doing} "
                                   f"(expected {kind.__name__})")
            elif not self.process.is_alive():
                break
        if self.process.is_alive():
            unfinished = self.receiver.unfinished()
            raise TimeoutError(f"the decode engine did not finish {doing} within {bound}={timeout_s}"
                               + (f" (pid {self.process.pid}: {unfinished})" if unfinished else ""))
        raise RuntimeError(f"the decode engine's process exited while {doing} (exit code {self.process.exitcode})")

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def gone(self) -> str:
        return f"the decode engine's process ended (exit code {self.process.exitcode})"

    def close(self) -> None:
        """Ask it to stop; kill it if it has not within JOIN_TIMEOUT_S (`_stop`)."""
        self._finalizer()


def _next_device(device: str) -> str:
    """The decode engine's default device: the GPU after the prefill engine's, or the CPU."""
    if not device.startswith("cuda"):
        return device
    import torch

    first = int(device.partition(":")[2] or torch.cuda.current_device())
    if first + 1 >= torch.cuda.device_count():
        raise ValueError(f"disaggregation needs a second GPU for the decode engine (cuda:{first + 1}); this machine "
                         f"has {torch.cuda.device_count()}: set decode_device")
    return f"cuda:{first + 1}"


def _stop(process, conn, sender: PipeSender, receiver: PipeReceiver) -> None:
    """The stop message (None) goes after every message queued before it; a process that has not
    ended JOIN_TIMEOUT_S later (one not reading holds it unsent: the same bound) is killed, which
    ends a write of the sender's or a read of the receiver's blocked on it (its end of the pipe
    closes); then both threads are joined (bounded)."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        sender.send(None)
    except OSError:
        pass  # its process is gone
    sender.flush(JOIN_TIMEOUT_S)
    process.join(max(0.0, deadline - time.monotonic()))
    if process.is_alive():
        process.kill()
        process.join(1.0)
    sender.close(1.0)
    receiver.close(1.0)
    conn.close()
