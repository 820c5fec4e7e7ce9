"""Entry-point error handling shared by `experiments.run`, `experiments.ab` and `experiments.showcase`:
bad configuration or input -> one line on stderr naming the key, exit code 2, no traceback.
`HYDRA_FULL_ERROR=1` brings back the full traceback for debugging.
"""
from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable
from typing import TypeVar

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

CONFIG_ERRORS = (ValueError, HydraException, OmegaConfBaseException)  # ConfigCompositionException is a HydraException
F = TypeVar("F", bound=Callable)
_user_full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"


def one_line(exc: BaseException) -> str:
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


def config_errors(fn: F) -> F:
    """Wrap a Hydra task function: config errors raised inside the job become one line + exit 2
    (before Hydra's job runner would print its own lines around them)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CONFIG_ERRORS as exc:
            if _user_full_error:
                raise
            _exit(exc)
    return wrapper  # type: ignore[return-value]


def run_cli(entry: Callable[[], object]) -> None:
    """Run an entry point (a @hydra.main function or a plain one); composition and other config
    errors become one line and exit code 2."""
    global _user_full_error
    _user_full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let exceptions reach us instead of Hydra's printer
    try:
        entry()
    except CONFIG_ERRORS as exc:
        if _user_full_error:
            raise
        _exit(exc)
    finally:
        if not _user_full_error:
            os.environ.pop("HYDRA_FULL_ERROR", None)
