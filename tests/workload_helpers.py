"""Shared by the workload tests: a trace file written in a test's folder, and the workload an
importer (replay by default) builds from it."""
from __future__ import annotations

from pathlib import Path

from experiments.lib.workloads import Workload, build_workload

VOCAB = 1000  # the model's vocabulary: drawn prompt ids lie in it, replayed ones are checked against it


def trace_workload(folder: Path, name: str, data: str | bytes, **cfg) -> Workload:
    """The `kind` (default replay) workload of the trace file `name` in `folder`, written holding
    `data` (text as UTF-8; bytes as they are, to write what is not UTF-8)."""
    path = folder / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return build_workload({"kind": "replay", "path": str(path), **cfg}, seed=0, vocab_size=VOCAB)
