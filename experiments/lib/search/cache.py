"""Results of a search by key (a hash of a deployment's run config, the workload in it, the SLOs
and the bisection's settings), one JSON line each, appended as each finishes: a rerun or an
interrupted search reads them back and simulates only what is missing."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CACHE_FILE = "results.jsonl"


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
