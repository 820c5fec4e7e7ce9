"""Where a run writes: a directory of its own even when other runs start in the same second."""
from __future__ import annotations

import datetime as dt
from pathlib import Path


def fresh_dir(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... : the first that this call creates (so runs started in the
    same second, in parallel, never write into one another's files)."""
    for i in range(1, 10_000):
        candidate = path if i == 1 else path.with_name(f"{path.name}-{i}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory next to {path}")


def default_run_dir(base: str | Path) -> Path:
    """`base/<date>/<time>` (created), or `<time>-2`, ... when another run took it this second: a
    command's output directory when none is given."""
    now = dt.datetime.now()
    return fresh_dir(Path(base) / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S"))


def fresh_run_dir(base: str) -> str:
    """`default_run_dir` as the `${fresh_run_dir:outputs/x}` resolver of the Hydra entry points'
    `hydra.run.dir`."""
    return str(default_run_dir(base))
