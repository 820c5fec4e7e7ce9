"""L2 prefetch qualifiers on the cp.async loads Triton emits (round 10 of kernels/NOTES.md).

Triton's pipeliner turns K/V tile loads into `cp.async.cg.shared.global [dst], [src], 16, n`
without a prefetch size; CUTLASS's sm80 copies (and so cuDNN's and FlashAttention-2's kernels) add
`.L2::128B`, which asks the L2 to fetch the whole 128-byte line on a miss.  Triton has no switch for
it, so a kernel opts in by passing a value through `mark_l2_prefetch`, which leaves a marker
comment in its PTX, and a compile-stage hook (`knobs.runtime.add_stages_inspection_hook`, present
in triton 3.6 and 3.7) adds the qualifier to every cp.async of a PTX module that carries a marker.
Kernels without the marker compile unchanged.  The hook is installed on first use only.
"""
from __future__ import annotations

import re

import triton
import triton.language as tl

MARKER = "servelab-l2-prefetch:"
SIZES = ("64B", "128B", "256B")
_CP_ASYNC = "cp.async.cg.shared.global "
_FOUND = re.compile(MARKER + r"(64B|128B|256B)")
_KEY = "servelab-ptx-hints-v1"


@triton.jit
def mark_l2_prefetch(x, SIZE: tl.constexpr):
    """`x` (int32) unchanged; the PTX of the kernel gets the marker for prefetch size SIZE."""
    if SIZE == "64B":
        x = tl.inline_asm_elementwise("mov.b32 $0, $1; // servelab-l2-prefetch:64B", "=r,r", [x],
                                      dtype=tl.int32, is_pure=False, pack=1)
    elif SIZE == "128B":
        x = tl.inline_asm_elementwise("mov.b32 $0, $1; // servelab-l2-prefetch:128B", "=r,r", [x],
                                      dtype=tl.int32, is_pure=False, pack=1)
    elif SIZE == "256B":
        x = tl.inline_asm_elementwise("mov.b32 $0, $1; // servelab-l2-prefetch:256B", "=r,r", [x],
                                      dtype=tl.int32, is_pure=False, pack=1)
    return x


def rewrite_ptx(ptx: str) -> str:
    """Add the marked prefetch size to every plain cp.async.cg of a marked PTX module."""
    found = set(_FOUND.findall(ptx))
    if not found:
        return ptx
    if len(found) > 1:
        raise ValueError(f"PTX carries conflicting L2 prefetch markers {sorted(found)}: one per kernel")
    size = found.pop()
    return ptx.replace(_CP_ASYNC, f"cp.async.cg.shared.global.L2::{size} ")


def check_size(size: str) -> None:
    if size and size not in SIZES:
        raise ValueError(f"l2_prefetch={size!r} is invalid: '' (none) or one of {SIZES}")


def install() -> None:
    """Install the compile-stage hook once (chained after any hook already set)."""
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "add_stages_inspection_hook"):
        raise RuntimeError(f"l2_prefetch needs triton.knobs.runtime.add_stages_inspection_hook, which "
                           f"triton {triton.__version__} lacks")
    previous = runtime.add_stages_inspection_hook
    if getattr(previous, "servelab_ptx_hints", False):
        return

    def hook(*args):
        if not args:  # asked for the cache key: kernels compiled with the hook get their own entries
            if previous is None:
                return _KEY, _KEY
            key, digest = previous()
            return key + _KEY, f"{digest}-{_KEY}"
        if previous is not None:
            previous(*args)
        stages = args[1]
        make_ptx = stages.get("ptx")
        if make_ptx is not None:
            stages["ptx"] = lambda src, metadata: rewrite_ptx(make_ptx(src, metadata))

    hook.servelab_ptx_hints = True
    runtime.add_stages_inspection_hook = hook
