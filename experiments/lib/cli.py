"""Entry-point error handling shared by `experiments.run`, `experiments.ab` and `experiments.showcase`:
bad configuration or input -> one line on stderr naming the key, exit code 2, no traceback.
`HYDRA_FULL_ERROR=1` brings back the full traceback for debugging.

In a sweep (`-m`), a job whose config is bad does not end the sweep: its line (naming the job's
number and overrides) is printed and written to `error.txt` in its run directory, the other jobs
run, and the sweep ends with exit code 2 and a list of the jobs that failed (docs/sweeps.md).
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

CONFIG_ERRORS = (ValueError, HydraException, OmegaConfBaseException)  # ConfigCompositionException is a HydraException
F = TypeVar("F", bound=Callable)
# The user's HYDRA_FULL_ERROR, kept where a sweep's worker processes (which inherit the
# HYDRA_FULL_ERROR=1 that run_cli sets) read it too.
_FULL_ERROR_ENV = "SERVELAB_USER_HYDRA_FULL_ERROR"
# One invocation's identity, which its sweep jobs (in this process or a launcher's workers, which
# inherit it) write under their error line, so its list holds its own failures and no earlier
# sweep's into the same directory.
_SWEEP_ID_ENV = "SERVELAB_SWEEP_ID"
JOB_ERROR_FILE = "error.txt"  # a failed sweep job's error line, then its sweep's identity


def _user_full_error() -> bool:
    return os.environ.get(_FULL_ERROR_ENV, os.environ.get("HYDRA_FULL_ERROR")) == "1"


class SweepJobError(Exception):
    """A sweep job's config error, raised to Hydra (which runs the other jobs, then raises the
    first failure): its one line and the sweep directory whose jobs' error files list all failures.
    Not a ValueError, so that run_cli tells it from a config error of the sweep itself."""

    def __init__(self, line: str, sweep_dir: str) -> None:
        super().__init__(line, sweep_dir)
        self.line, self.sweep_dir = line, sweep_dir


def one_line(exc: BaseException) -> str:
    from experiments.lib.config_schema import unknown_override  # the schemas: only when reporting
    unknown = unknown_override(exc)
    if unknown is not None:
        return unknown
    text = str(exc).strip() or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    msg = lines[0]
    options = re.search(r"Available options in '([^']+)':\n((?:\t[^\n]*\n?)+)", text)
    if options:
        names = ", ".join(o.strip() for o in options.group(2).splitlines() if o.strip())
        msg += f" (available options in '{options.group(1)}': {names})"
    else:
        detail = next((ln for ln in lines[1:] if ln.startswith(("Key ", "full_key", "Could not"))), None)
        cause = exc.__cause__
        if detail is None and cause is not None and str(cause).strip():
            detail = str(cause).strip().splitlines()[0]
        if detail and detail not in msg:  # a re-raised error's cause often repeats it
            msg += f" ({detail})"
    return msg


def _exit(exc: BaseException) -> None:
    print(f"error: {one_line(exc)}", file=sys.stderr)
    sys.exit(2)


def _sweep_job() -> tuple[str, Path, str] | None:
    """(the job's name: its number and overrides, its run directory, the sweep directory) in a
    job of a Hydra multirun; None otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return f"job {hc.job.num} ({' '.join(hc.overrides.task)})", Path(hc.runtime.output_dir), str(hc.sweep.dir)


def config_errors(fn: F) -> F:
    """Wrap a Hydra task function: config errors raised inside the job become one line + exit 2
    (before Hydra's job runner would print its own lines around them). In a sweep's job the line
    names the job, goes to its run directory's error.txt too, and the sweep goes on (SweepJobError)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        job = _sweep_job()
        if job is not None:  # a run directory reused from an earlier sweep: its old error is gone
            (job[1] / JOB_ERROR_FILE).unlink(missing_ok=True)
        try:
            return fn(*args, **kwargs)
        except CONFIG_ERRORS as exc:
            if _user_full_error():
                raise
            if job is None:
                _exit(exc)
            name, run_dir, sweep_dir = job
            line = f"{name}: {one_line(exc)}"
            print(f"error: {line}", file=sys.stderr)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / JOB_ERROR_FILE).write_text(f"{line}\nsweep {os.environ.get(_SWEEP_ID_ENV, '')}\n")
            raise SweepJobError(line, sweep_dir) from None
    return wrapper  # type: ignore[return-value]


def sweep_failures(sweep_dir: str | Path, sweep_id: str | None = None) -> list[str]:
    """The error lines of a sweep's failed jobs, by job number: the error.txt files under its
    directory that carry `sweep_id` (default: this invocation's), not an earlier sweep's into the
    same directory."""
    sweep_id = os.environ.get(_SWEEP_ID_ENV, "") if sweep_id is None else sweep_id
    lines = []
    for path in Path(sweep_dir).rglob(JOB_ERROR_FILE):
        try:
            text = path.read_text().splitlines()
        except OSError:
            continue
        if len(text) >= 2 and text[1] == f"sweep {sweep_id}":
            lines.append(text[0].strip())
    number = re.compile(r"job (\d+) ")
    return sorted(lines, key=lambda ln: int(m.group(1)) if (m := number.match(ln)) else -1)


def _exit_sweep(exc: SweepJobError) -> None:
    failed = sweep_failures(exc.sweep_dir) or [exc.line]
    print(f"error: {len(failed)} job(s) of the sweep failed (the others ran; each failed job's error is in "
          f"its run directory's {JOB_ERROR_FILE} under {exc.sweep_dir}):", file=sys.stderr)
    for line in failed:
        print(f"  {line}", file=sys.stderr)
    sys.exit(2)


def run_cli(entry: Callable[[], object]) -> None:
    """Run an entry point (a @hydra.main function or a plain one); composition and other config
    errors become one line and exit code 2; a sweep whose jobs had config errors ends with their
    list and exit code 2."""
    user_full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ[_FULL_ERROR_ENV] = "1" if user_full_error else "0"
    os.environ[_SWEEP_ID_ENV] = uuid.uuid4().hex
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let exceptions reach us instead of Hydra's printer
    try:
        entry()
    except SweepJobError as exc:
        _exit_sweep(exc)
    except CONFIG_ERRORS as exc:
        if user_full_error:
            raise
        _exit(exc)
    finally:
        os.environ.pop(_FULL_ERROR_ENV, None)
        os.environ.pop(_SWEEP_ID_ENV, None)
        if not user_full_error:
            os.environ.pop("HYDRA_FULL_ERROR", None)


def check_at_least(parser: argparse.ArgumentParser, *checks: tuple[str, int, int]) -> None:
    """Each (flag, value, least): `parser.error` naming the first flag whose integer is below its least."""
    for flag, value, least in checks:
        if value < least:
            parser.error(f"{flag}={value} is invalid: must be an integer >= {least}")
