"""Where relative paths in configs resolve: the working directory first, then the repository root."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    in_repo = REPO_ROOT / p
    return in_repo if in_repo.exists() else p
