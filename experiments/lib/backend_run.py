"""`BackendRun`: what a backend (experiments/lib/backends.py) reports of a run besides its trace."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policies.trace import TraceRecorder


@dataclass(slots=True)
class BackendRun:
    num_steps: int
    elapsed_s: float  # from t = 0 to the end of the last request, on the backend's clock
    clock: str  # "simulated" or "wall"
    info: dict[str, Any] = field(default_factory=dict)  # extras for summary.json
    # A fleet's runs: each replica's traces (the recorder handed to the backend stays empty).
    replica_recorders: list[TraceRecorder] | None = None
