"""Entry-point error handling shared by `experiments.run`, `experiments.ab` and `experiments.showcase`:
bad configuration or input -> one line on stderr naming the key, exit code 2, no traceback.
`HYDRA_FULL_ERROR=1` brings back the full traceback for debugging.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Callable

from hydra.errors import ConfigCompositionException, HydraException
from omegaconf.errors import OmegaConfBaseException


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
        if detail:
            msg += f" ({detail})"
    return msg


def run_cli(entry: Callable[[], object]) -> None:
    """Run a @hydra.main function; turn config errors into one line and exit code 2."""
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let exceptions reach us instead of Hydra's printer
    try:
        entry()
    except (ValueError, ConfigCompositionException, OmegaConfBaseException, HydraException) as exc:
        if full_error:
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        sys.exit(2)
