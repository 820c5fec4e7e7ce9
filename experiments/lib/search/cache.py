"""Results of a search by key (a hash of a deployment's run config, the workload in it, the SLOs,
the bisection's settings and the contents of the latency model's data files), one JSON line each, appended as each finishes: a rerun or an
interrupted search reads them back and simulates only what is missing."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CACHE_FILE = "results.jsonl"
_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime) -> sha256 of the file


def data_digest(paths: list[Path]) -> str:
    """A hash of these files' contents: a latency profile retaken under the same name is other data,
    so results simulated on the old one are not reused."""
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
        if key not in _DIGESTS:
            _DIGESTS[key] = hashlib.sha256(p.read_bytes()).hexdigest()
        h.update(f"{p.name}:{_DIGESTS[key]};".encode())
    return h.hexdigest()[:24]


def result_key(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class ResultCache:
    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / CACHE_FILE
        self.rows: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by an interruption: simulated again
                    continue
                self.rows[row["key"]] = row["result"]

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def get(self, key: str) -> dict[str, Any]:
        return self.rows[key]

    def put(self, key: str, result: dict[str, Any]) -> None:
        self.rows[key] = result
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"key": key, "result": result}, default=str) + "\n")
