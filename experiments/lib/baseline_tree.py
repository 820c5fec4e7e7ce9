"""A commit's source tree extracted beside this one, for benchmarks that measure a baseline commit
and this tree in one run (`git archive REF`, untarred into a folder)."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository this file is in


def extract(ref: str, dest: Path) -> Path:
    """`ref`'s tree of this repository under `dest` (created); ValueError naming an unknown ref."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=False, capture_output=True)
    if archive.returncode:
        raise ValueError(f"baseline={ref!r} is invalid: git archive says "
                         f"{archive.stderr.decode(errors='replace').strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest
