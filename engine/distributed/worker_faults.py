"""How rank 0 of a tensor-parallel engine notices a worker that failed, and what it tells the user.

Every wait of rank 0 on its workers watches their process sentinels too, so a worker that dies
ends the wait within a fraction of a second, whatever rank 0 waits for: a worker's message
(`await_workers`), the group's rendezvous (`run_watched`), or a collective (the caller's own bound).
The error, `WorkerFailure`, names the rank, its pid, its exit code and the error the worker
reported down its pipe, if it lived long enough to report one.

One cause gets its own advice: spawn starts each worker by re-importing the user's main module, so
a script that starts an engine at its top level (no `if __name__ == "__main__":`) starts it again
inside the worker. The worker sees this (`refuse_in_spawn_bootstrap`) and exits with
`MAIN_NOT_GUARDED_EXIT`, which rank 0 turns into the fix.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TypeVar

T = TypeVar("T")

# A worker's exit code when spawn's re-import of the main module started another engine.
MAIN_NOT_GUARDED_EXIT = 87
MAIN_GUARD_HINT = ("the script starts the engine at its top level: spawn starts each tensor-parallel worker by "
                   "re-importing the main module, which started the engine again inside the worker. Put the code "
                   "that starts the engine under `if __name__ == \"__main__\":` (Python's multiprocessing docs, "
                   "'Safe importing of main module')")
_POLL_S = 0.1


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died, hung or failed to start; the engine is closed."""


def refuse_in_spawn_bootstrap() -> None:
    """Leave at once if this process is a spawned child still importing the main module (spawn's
    bootstrap): the main module starts an engine, and starting it here would spawn workers of
    workers. The exit code tells rank 0 why."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(f"servelab: tensor-parallel worker not started: {MAIN_GUARD_HINT}", file=sys.stderr, flush=True)
        raise SystemExit(MAIN_NOT_GUARDED_EXIT)


def reported_error(link: Connection) -> str | None:
    """The error a worker sent before it exited, if any (its last messages are still in the pipe)."""
    with contextlib.suppress(OSError, EOFError):
        while link.poll(0.2):
            kind, detail = link.recv()
            if kind == "error":
                return str(detail).strip()
    return None


def died(rank: int, proc: BaseProcess, link: Connection, what: str) -> WorkerFailure:
    """The failure of a worker that has exited, with its reported error or the main-guard advice."""
    if proc.exitcode == MAIN_NOT_GUARDED_EXIT:
        return WorkerFailure(f"tensor-parallel worker {rank} (pid {proc.pid}) exited during {what} with exit code "
                             f"{proc.exitcode}: {MAIN_GUARD_HINT}")
    reported = reported_error(link)
    detail = (f": {reported}" if reported else
              " before it reported an error (what it printed, if anything, is on this process's stderr)")
    return WorkerFailure(f"tensor-parallel worker {rank} (pid {proc.pid}) died during {what} with "
                         f"exit code {proc.exitcode}{detail}")


def first_death(procs: Sequence[BaseProcess], links: Sequence[Connection], what: str,
                grace_s: float = 0.0) -> WorkerFailure | None:
    """The failure of the first worker that has exited, waiting up to `grace_s` for one to."""
    deadline = time.monotonic() + grace_s
    while True:
        for rank, (proc, link) in enumerate(zip(procs, links), start=1):
            if proc.exitcode is not None:
                return died(rank, proc, link, what)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        wait([p.sentinel for p in procs], timeout=min(remaining, _POLL_S))


def await_workers(procs: Sequence[BaseProcess], links: Sequence[Connection], expected: str, timeout_s: float,
                  what: str) -> None:
    """Wait until every worker has sent `expected` down its link; raise `WorkerFailure` as soon as
    one reports an error or exits, or when `timeout_s` passes."""
    pending = dict(enumerate(links, start=1))
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorkerFailure(f"tensor-parallel workers {sorted(pending)} did not report {expected!r} within "
                                f"{timeout_s:.0f} s during {what}")
        ready = wait([*pending.values(), *(procs[r - 1].sentinel for r in pending)], timeout=remaining)
        for rank, link in list(pending.items()):
            proc = procs[rank - 1]
            if link not in ready and proc.sentinel not in ready:
                continue
            message = None
            with contextlib.suppress(EOFError, OSError):
                if link.poll():
                    message = link.recv()
            if message is None:  # end of file or no message: the worker is gone (or going)
                proc.join(2.0)
                if proc.exitcode is None:
                    continue
                raise died(rank, proc, link, what)
            kind, detail = message
            if kind == "error":
                proc.join(2.0)
                raise WorkerFailure(f"tensor-parallel worker {rank} (pid {proc.pid}) failed during {what}"
                                    f"{'' if proc.exitcode is None else f' (exit code {proc.exitcode})'}: "
                                    f"{str(detail).strip()}")
            if kind == expected:
                del pending[rank]


def run_watched(fn: Callable[[], T], procs: Sequence[BaseProcess], links: Sequence[Connection],
                timeout_s: float, what: str) -> T:
    """`fn()` on a helper thread while this one watches the workers: a worker's death (or
    `timeout_s`) raises `WorkerFailure` at once. For waits that cannot be interrupted (the
    group's rendezvous waits for every rank); the helper is left to its own deadline then."""
    result: list = []

    def call() -> None:
        try:
            result.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 (raised again on the calling thread)
            result.append((False, e))

    helper = threading.Thread(target=call, name=f"tp-{what}", daemon=True)
    helper.start()
    deadline = time.monotonic() + timeout_s
    while helper.join(_POLL_S) or helper.is_alive():
        failure = first_death(procs, links, what)
        if failure is not None:
            raise failure
        if time.monotonic() > deadline:
            raise WorkerFailure(f"tensor-parallel {what} did not finish within {timeout_s:.0f} s")
    ok, value = result[0]
    if not ok:
        raise value
    return value
