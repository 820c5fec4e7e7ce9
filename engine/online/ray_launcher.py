"""`--replica-launcher ray`: each replica's engine core in a Ray actor, on whichever host of the Ray
cluster has its GPUs (`pip install servelab[ray]`).

The actor runs the engine core's own loop (engine/online/engine_core.py:serve) in a thread, over a
pair of pipes inside the actor; the front end's `RayCoreClient` has `EngineCoreClient`'s face, so
the same `ProcessHost` drives it: requests and aborts go to the actor as `submit` calls (one caller,
one sequential actor: in order), and a task on the event loop fetches the core's messages with
`poll` calls (at once while they come, then every `POLL_IDLE_S`). The actor dying, or its loop
ending, is the replica's death.

Ray is joined with `ray.init()` if this process has not already: the cluster `RAY_ADDRESS` names,
else a local instance. Each actor asks for `tensor_parallel_size` GPUs on CUDA (Ray then sets its
`CUDA_VISIBLE_DEVICES`, so the engine runs on its `cuda:0`), none on the CPU, and one CPU. The
front end loads the tokenizer of the same weights: every host needs the model's files at the same
path (or the same conf/model name).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
from typing import Any

from engine.engine_args import EngineArgs
from engine.offline.tokenizer import tokenizer_for
from engine.online.core_channel import read_message, readable, write_message
from engine.online.engine_core import serve
from engine.online.process_host import ProcessHost
from engine.online.replica_set import REPLICA_LAUNCHERS, Replica

POLL_IDLE_S = 0.002  # between polls that brought nothing
START_TIMEOUT_S = 900.0


class EngineCoreActor:
    """The engine core inside a Ray actor (wrapped by `ray.remote` at launch)."""

    def __init__(self, args: EngineArgs, keep_trace: bool, report_index: bool) -> None:
        from engine.offline.llm_engine import LLMEngine
        from engine.online.engine_core import core_info
        self.engine = LLMEngine(args)
        self.core_info = core_info(self.engine)
        inbox_r, self._inbox = os.pipe()
        self._outbox, outbox_w = os.pipe()
        self._ended = False
        self._thread = threading.Thread(target=self._run, args=(keep_trace, inbox_r, outbox_w, report_index),
                                        name="servelab-engine-core", daemon=True)
        self._thread.start()

    def _run(self, keep_trace: bool, inbox: int, outbox: int, report_index: bool) -> None:
        try:
            serve(self.engine, keep_trace, inbox, outbox, set() if report_index else None)
        except SystemExit:  # serve reported its failure as a message
            pass
        finally:
            os.close(outbox)  # the front end's poll sees the end
            os.close(inbox)

    def info(self):
        return self.core_info

    def submit(self, batch: Any) -> None:
        write_message(self._inbox, batch)

    def poll(self) -> tuple[list[Any], bool]:
        """The core's messages sent so far, and whether its loop has ended."""
        messages = []
        while not self._ended and readable(self._outbox):
            try:
                messages.append(read_message(self._outbox))
            except EOFError:
                self._ended = True
        return messages, self._ended

    def stop(self) -> None:
        try:
            write_message(self._inbox, None)
        except OSError:
            pass
        self._thread.join(10.0)
        self.engine.close()


class RayChannel:
    """`LoopChannel`'s face over the actor's `submit` and `poll` calls."""

    def __init__(self, actor) -> None:
        self.actor = actor
        self.closed = False
        self.pending = False
        self._task: asyncio.Task | None = None

    def attach(self, loop: asyncio.AbstractEventLoop, on_message, on_closed) -> None:
        self.detach()
        if not self.closed:
            self._task = loop.create_task(self._poll(on_message, on_closed), name="servelab-ray-poll")

    def detach(self, close: bool = False) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
        if close:
            self.closed = True

    def send(self, message: Any) -> None:
        if self.closed:
            raise BrokenPipeError("the engine actor is gone")
        self.actor.submit.remote(message)

    async def _poll(self, on_message, on_closed) -> None:
        while True:
            try:
                messages, ended = await self.actor.poll.remote()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 (the actor died: the replica's end, reported below)
                messages, ended = [], True
            for message in messages:
                on_message(message)
            if ended:
                self.closed = True
                on_closed()
                return
            await asyncio.sleep(0 if messages else POLL_IDLE_S)


class RayCoreClient:
    """`EngineCoreClient`'s face for an engine core in a Ray actor."""

    def __init__(self, args: EngineArgs, keep_trace: bool = False, report_index: bool = False,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        import ray
        if not ray.is_initialized():
            ray.init()
        self.args = args
        gpus = args.tensor_parallel_size if (args.device or args.resolve_device()).startswith("cuda") else 0
        actor_cls = ray.remote(num_cpus=1, num_gpus=gpus)(EngineCoreActor)
        self.actor = actor_cls.remote(args, keep_trace, report_index)
        try:
            self.info = ray.get(self.actor.info.remote(), timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.actor)
            raise TimeoutError(f"the engine actor did not start within {start_timeout_s} s") from None
        except ray.exceptions.RayActorError as exc:
            cause = exc.__cause__ or exc
            if isinstance(cause, ValueError):
                raise ValueError(str(cause)) from None  # noqa: TRY004 (bad arguments: a ValueError, as locally)
            raise RuntimeError(f"the engine actor could not build the engine: {cause}") from None
        self.channel = RayChannel(self.actor)
        self.tokenizer = tokenizer_for(args.tokenizer, args.model_config().weights)
        self._gone = False

    @property
    def alive(self) -> bool:
        return not self.channel.closed

    def exit_reason(self, wait_s: float) -> str:
        return "the engine actor ended (its process exited or its loop stopped)"

    def shutdown(self, timeout_s: float = 10.0) -> None:
        import ray
        self.channel.detach(close=True)
        if self._gone:
            return
        self._gone = True
        with contextlib.suppress(Exception):  # dead, hung or gone: killed below either way
            ray.get(self.actor.stop.remote(), timeout=timeout_s)
        ray.kill(self.actor)


@REPLICA_LAUNCHERS.register("ray")
def launch_ray(replica: int, args: EngineArgs, data_parallel_size: int, keep_trace: bool,
               report_index: bool) -> Replica:
    device = args.device or args.resolve_device()  # set: the actors' hosts have it, this one may not
    if device.startswith("cuda"):  # Ray gives the actor its GPUs: it sees them from cuda:0
        args = dataclasses.replace(args, device="cuda")
    client = RayCoreClient(args, keep_trace, report_index)
    return Replica(replica, ProcessHost(client), args.block_size, client.info.num_gpu_blocks)
