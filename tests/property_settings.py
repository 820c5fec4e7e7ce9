"""How many examples a property test draws: `examples(n)` is `n` under the `ci` hypothesis profile
(tests/conftest.py: fixed and derandomized) and `n * SOAK_FACTOR` (default 20) under `soak`
(`make soak`: random seeds, many more examples)."""
from __future__ import annotations

import os

from hypothesis import settings


def examples(n: int) -> int:
    if settings.get_current_profile_name() != "soak":
        return n
    return n * int(os.environ.get("SOAK_FACTOR", "20"))
