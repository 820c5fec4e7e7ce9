"""Where relative paths in configs resolve: the working directory first, then the repository root;
and writing a command's output file, an unwritable one said as the option that named it."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    in_repo = REPO_ROOT / p
    return in_repo if in_repo.exists() else p


def write_output(path: Path, text: str, option: str) -> None:
    """`text` into `path` (its folder made); ValueError naming `option` and the path where the file
    cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise ValueError(f"{option}={str(path)!r} is invalid: cannot write it ({exc.strerror})") from None
