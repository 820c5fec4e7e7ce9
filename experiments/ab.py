"""`python -m experiments.ab a='[OVERRIDES]' b='[OVERRIDES]' [COMMON OVERRIDES] [--out DIR]
[--rounds N]`

Runs two configs that differ by the overrides in `a` and `b` (Hydra overrides, comma-separated
in brackets, e.g. `a='[policy=fcfs]' b='[policy=priority]'`) on the identical request stream (the
workload is built once from the common config; a and b may not change it), pairs the requests by
id and reports B - A for every per-request latency (mean, p50, p90, p99; per priority class and per
tenant too)
with paired-bootstrap confidence intervals, plus the run-level metrics. Writes `a/` and `b/` run
dirs (full traces), `ab.csv`, `ab.md` and `ab.png` into the output dir
(default `outputs/ab/<date>/<time>`) and prints the table. Works with any backend
(`backend=...` as a common override, or in a/b). `--rounds N` runs A, B, A, B, ... N times (run
dirs `a_r2/`, `b_r2/`, ...): on the GPU a run's host CPU speed drifts by several percent, which the
per-request bootstrap of one pair cannot see, so a change counts only if it reproduces (see
`experiments.lib.bootstrap.combine_rounds`). With backend=engine, A runs once unrecorded first
(`--no-warmup` skips it): the engine's first run compiles kernels for new shapes.

    python -m experiments.ab a='[policy=fcfs]' b='[policy=priority]' workload=priority
    python -m experiments.ab a='[policy.preemption_mode=recompute]' b='[policy.preemption_mode=swap]' \\
        blocks.num_gpu_blocks=2000
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from experiments.lib.ab_compare import ABResult, compare, compose_pair, markdown
from experiments.lib.cli import run_cli
from experiments.lib.run_dirs import default_run_dir


def split_overrides(text: str, name: str) -> list[str]:
    """`[x=1,y=[2,3]]` -> ['x=1', 'y=[2,3]'] (commas inside brackets or quotes stay); `x=1` -> ['x=1'].
    Unbalanced brackets or quotes anywhere are refused, naming the side."""
    text = text.strip()
    _top_level_commas(text, name)  # the whole text balanced
    if not (text.startswith("[") and text.endswith("]")):
        return [text] if text else []
    inner = text[1:-1]
    cuts = [-1, *_top_level_commas(inner, name, text), len(inner)]
    return [item for a, b in pairwise(cuts) if (item := inner[a + 1:b].strip())]


def _top_level_commas(text: str, name: str, shown: str | None = None) -> list[int]:
    """The positions of the commas of `text` outside brackets and quotes; ValueError naming the
    side (and `shown`, the text as given) when its brackets or quotes do not balance."""
    depth, quote, commas = 0, "", []
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
            if depth < 0:
                break
        elif ch == "," and depth == 0:
            commas.append(i)
    if depth or quote:
        raise ValueError(f"{name}={shown or text!r} is invalid: unbalanced brackets or quotes "
                         f"(e.g. {name}='[policy=fcfs]')")
    return commas


def _side_like(item: str) -> bool:
    """`c=[policy=sjf]`: a bracketed list of overrides under a name that is no side (only a and b are)."""
    key, _, value = item.partition("=")
    value = value.strip()
    return (key.isidentifier() and value.startswith("[") and value.endswith("]")
            and re.match(r"\[\s*[+~]?[\w.@/]+=", value) is not None)


def _main(argv: Sequence[str] | None = None) -> ABResult:
    parser = argparse.ArgumentParser(prog="python -m experiments.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="a=[...] b=[...] and common Hydra overrides")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default outputs/ab/<date>/<time>)")
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                        help="run A once unrecorded first (default: with backend=engine, whose first run JIT-compiles)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run A and B this many times, alternating; a change is significant only if it "
                             "reproduces in every round beyond the runs' own spread (wall-clock backends)")
    args = parser.parse_intermixed_args(argv)  # options and overrides in any order
    a, b, common = None, None, []
    for item in args.overrides:
        if item.startswith("a="):
            a = split_overrides(item[2:], "a")
        elif item.startswith("b="):
            b = split_overrides(item[2:], "b")
        elif _side_like(item):
            name = item.partition("=")[0]
            raise ValueError(f"{name}={item.partition('=')[2]!r} is invalid: only a='[...]' and b='[...]' hold "
                             "a side's overrides; a common override is key=value (e.g. policy=fcfs)")
        else:
            common.append(item)
    if a is None or b is None:
        raise ValueError("a and b are required: e.g. a='[policy=fcfs]' b='[policy=priority]'")
    if args.resamples < 1:
        raise ValueError(f"--resamples={args.resamples} is invalid: must be >= 1")
    cfg_a, cfg_b = compose_pair(common, a, b)
    out = args.out or default_run_dir("outputs/ab")
    label_a, label_b = ",".join(a) or "base", ",".join(b) or "base"
    result = compare(cfg_a, cfg_b, out, label_a, label_b, args.resamples, args.confidence, args.rounds, args.warmup)
    print(f"A = {label_a}\nB = {label_b}\ncommon: {' '.join(common) or '(defaults)'}\n")
    print(markdown(result.table, label_a, label_b, args.confidence))
    print(f"runs, ab.csv, ab.md, ab.png in {out}")
    return result


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
