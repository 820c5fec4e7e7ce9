"""Process checks shared by the tests that start and stop engine processes (core processes,
tensor-parallel workers)."""
from __future__ import annotations


def gone(pid: int) -> bool:
    """The process has exited (no such pid, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
