"""Operator profile files (`experiments/profiles/operators/<gpu>-<dtype>-<part>.csv`): the schema,
reading with validation, and writing. One GPU type's files, loaded together as each operator's
time: operator_profile.py.

Format (v1): leading `# key: value` lines (metadata), then a CSV header and one row per timing:

    op,m,k,n,num_heads,num_kv_heads,head_dim,context,bytes,world_size,time_s

Metadata keys: `format` (`servelab operator profile v1`), `gpu` (the conf/hardware name the file
is for), `device` (the GPU's name, checked against the run's hardware: file_meta.py), `dtype`, `kernels` (the decode kernel the attention rows ran,
or `collectives`), `versions` (torch, triton, CUDA), `date`, `command`, `time_unit` (`s`), and
`grid` (JSON: the operator grid the rows were measured on; each list strictly increasing).

Rows, by `op` (its axes in brackets; unused columns empty; sizes are integers >= 1 except
`context`, >= 0; `time_s` is seconds, > 0):
- `gemm` [m, k, n]: x[m, k] @ W[k, n] in the engine's dtype (torch.nn.functional.linear).
- `decode_attention` [head_dim, num_kv_heads, group, m, context]: the paged decode kernel over m
  sequences of `context` tokens each (block tables as wide as the engine's graphs hold them), `group` = num_heads / num_kv_heads query heads per KV head.
- `prefill_attention` [same axes]: the paged prefill kernel, one sequence of m new tokens after a
  prefix of `context` cached tokens.
- `qk_rope_write` [head_dim, num_kv_heads, group, m]: q/k RMSNorm + RoPE + KV cache write of m tokens.
- `rms_norm`, `add_rms_norm`, `embedding` [m, n]: m tokens of width n (the hidden size);
  `silu_and_mul` [m, n]: n = its output width (the MLP's intermediate size); `sampler` [m, n]:
  m rows over a vocabulary of n.
- `copy_blocks`, `swap_out`, `swap_in` [bytes]: KV blocks copied on the GPU / to / from pinned
  host memory, `bytes` moved one way.
- `graph_launch` [m]: wall time of launching a CUDA graph of m kernels and waiting for it.
- `all_reduce`, `all_gather` [bytes] per `world_size` (>= 2): `bytes` of the result on each rank
  (NCCL; gloo on the CPU). `all_reduce_one_shot`, `all_reduce_two_shot` [bytes] per `world_size`:
  the engine's symmetric-memory all-reduce paths with torch's kernels, where the GPUs had them
  (`ALL_REDUCE_PATH_OPS`). `all_reduce_add_rms_norm` [bytes, n] per `world_size`: the Triton
  kernel that all-reduces a message of rows n wide and adds the residual and RMSNorms the sums in
  one (the engine's fused layer boundary, `all_reduce_kernel=triton_fused`), where the GPUs had it;
  `all_reduce_add_rms_norm_lamport` [bytes, n] the same boundary by the barrier-free kernel
  (`all_reduce_kernel=triton_lamport`).
- `reduce_scatter` [bytes] per `world_size`: `bytes` of the input on each rank, each rank getting
  the sum of its 1/N (NCCL; gloo on the CPU).
- `all_gather_matmul`, `matmul_reduce_scatter` [m, k, n] per `world_size`: a sequence-parallel
  layer boundary (engine/models/sequence_parallel.py) as the engine's group runs it (torch's fused
  symmetric-memory ops where the GPUs had them, else the collective and the GEMM one after the
  other): m/N rows of width k on each rank gathered, then @ W[k, n] (m rows out); or m rows @
  W[k, n], the result reduce-scattered (m/N rows of the sum out). Their cells over the grid's caps
  are filled as `gemm`'s (operator_profile.py).
"""
from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping
from itertools import pairwise
from pathlib import Path

from sim.latency.file_meta import read_meta, text_lines

FORMAT = "servelab operator profile v1"
COLUMNS = ("op", "m", "k", "n", "num_heads", "num_kv_heads", "head_dim", "context", "bytes", "world_size", "time_s")
ATTENTION_AXES = ("head_dim", "num_kv_heads", "group", "m", "context")
OP_AXES: dict[str, tuple[str, ...]] = {
    "gemm": ("m", "k", "n"),
    "decode_attention": ATTENTION_AXES,
    "prefill_attention": ATTENTION_AXES,
    "qk_rope_write": ("head_dim", "num_kv_heads", "group", "m"),
    "rms_norm": ("m", "n"),
    "add_rms_norm": ("m", "n"),
    "silu_and_mul": ("m", "n"),
    "embedding": ("m", "n"),
    "sampler": ("m", "n"),
    "copy_blocks": ("bytes",),
    "swap_out": ("bytes",),
    "swap_in": ("bytes",),
    "graph_launch": ("m",),
    "all_reduce": ("bytes",),
    "all_gather": ("bytes",),
    "all_reduce_one_shot": ("bytes",),
    "all_reduce_two_shot": ("bytes",),
    "all_reduce_add_rms_norm": ("bytes", "n"),
    "all_reduce_add_rms_norm_lamport": ("bytes", "n"),
    "reduce_scatter": ("bytes",),
    "all_gather_matmul": ("m", "k", "n"),
    "matmul_reduce_scatter": ("m", "k", "n"),
}
COLLECTIVES = ("all_reduce", "all_gather")  # NCCL's: every collectives file has them
SYMMETRIC_ALL_REDUCES = ("all_reduce_one_shot", "all_reduce_two_shot")  # where symmetric memory was available
FUSED_ALL_REDUCE = "all_reduce_add_rms_norm"  # the fused layer boundary: all-reduce + residual add + RMSNorm
LAMPORT_FUSED_ALL_REDUCE = "all_reduce_add_rms_norm_lamport"  # the same boundary, the barrier-free kernel
# The kernels whose fused boundary has rows of its own (`all_reduce_kernel` -> op).
FUSED_BOUNDARY_OPS = {"triton_fused": FUSED_ALL_REDUCE, "triton_lamport": LAMPORT_FUSED_ALL_REDUCE}
# The sequence-parallel step's row collectives: the boundaries' GEMMs with their collective, and the
# reduce-scatter of the embedding's sums (its final all-gather is `all_gather`'s).
SEQUENCE_PARALLEL_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "reduce_scatter")
PER_WORLD_SIZE = (*COLLECTIVES, *SYMMETRIC_ALL_REDUCES, FUSED_ALL_REDUCE, LAMPORT_FUSED_ALL_REDUCE,
                  *SEQUENCE_PARALLEL_OPS)  # per world size
# The collectives file's metadata key saying which implementation its boundary rows timed, per
# world size (JSON: {"2": "fused"}; "fused": torch's symmetric-memory ops, "plain": the collective
# beside the GEMM).
SEQUENCE_PARALLEL_META = "sequence_parallel_ops"
GEMM_OPS = ("gemm", "all_gather_matmul", "matmul_reduce_scatter")  # [m, k, n], unmeasured cells filled
# The engine's all-reduce paths (engine/distributed/all_reduce_path.py: ONE_SHOT, TWO_SHOT, NCCL)
# and the op whose rows time each.
ALL_REDUCE_PATH_OPS = {"one-shot": "all_reduce_one_shot", "two-shot": "all_reduce_two_shot", "nccl": "all_reduce"}
REQUIRED_META = ("format", "gpu", "device", "dtype", "kernels", "versions", "date", "time_unit", "grid")
ZERO_ALLOWED = ("context",)  # axes whose size may be 0
MAX_TIME_S = 60.0  # one operator call; anything longer is a unit mistake (ms written as s)


def _parse_row(path: Path, line: int, raw: Mapping[str, str]) -> dict[str, float]:
    op = raw.get("op", "")
    if op not in OP_AXES:
        raise ValueError(f"{path}:{line}: op={op!r} is invalid: one of {sorted(OP_AXES)}")
    needed = {"group": ("num_heads", "num_kv_heads")}
    columns = [c for a in OP_AXES[op] for c in needed.get(a, (a,))]
    if op in PER_WORLD_SIZE:
        columns.append("world_size")
    row: dict[str, float] = {"world_size": 1}
    for col in [*columns, "time_s"]:
        text = (raw.get(col) or "").strip()
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{path}:{line}: {col}={text!r} is invalid for op={op}: a number is needed") from None
        if col == "time_s":
            if not (0 < value < MAX_TIME_S) or not math.isfinite(value):
                raise ValueError(f"{path}:{line}: time_s={text} is invalid: seconds, > 0 and < {MAX_TIME_S}")
        elif value != int(value) or value < (0 if col in ZERO_ALLOWED else 1):
            low = 0 if col in ZERO_ALLOWED else 1
            raise ValueError(f"{path}:{line}: {col}={text} is invalid for op={op}: an integer >= {low}")
        row[col] = value
    if op in PER_WORLD_SIZE and row["world_size"] < 2:
        raise ValueError(f"{path}:{line}: world_size={row['world_size']:.0f} is invalid for op={op}: must be >= 2")
    if "num_heads" in row and row["num_heads"] % row["num_kv_heads"]:
        raise ValueError(f"{path}:{line}: num_heads={row['num_heads']:.0f} is invalid: must be a multiple of "
                         f"num_kv_heads={row['num_kv_heads']:.0f}")
    return row


def read_operator_file(path: str | Path) -> tuple[dict[str, str], list[tuple[str, dict[str, float]]]]:
    """(metadata, [(op, parsed row)]); raises ValueError naming the file, line and field."""
    path = Path(path)
    lines = list(text_lines(path))
    meta, body_start = read_meta(lines)
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(f"{path}: metadata {missing} missing: an operator profile carries {list(REQUIRED_META)}")
    if meta["format"] != FORMAT:
        raise ValueError(f"{path}: format={meta['format']!r} is invalid: expected {FORMAT!r}")
    if meta["time_unit"] != "s":
        raise ValueError(f"{path}: time_unit={meta['time_unit']!r} is invalid: times are written in seconds ('s')")
    try:
        grid = json.loads(meta["grid"])
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: metadata grid is not JSON ({e})") from None
    for key, values in _grid_lists(grid):
        if any(b <= a for a, b in pairwise(values)):
            raise ValueError(f"{path}: grid.{key}={values} is invalid: must be strictly increasing")
    reader = csv.DictReader(lines[body_start:])
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise ValueError(f"{path}: columns {reader.fieldnames} are invalid: expected {list(COLUMNS)}")
    rows = [(raw["op"], _parse_row(path, body_start + 2 + i, raw)) for i, raw in enumerate(reader)]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return meta, rows


def _grid_lists(grid: object, prefix: str = "") -> Iterable[tuple[str, list]]:
    """Every list of numbers in the grid JSON, with its dotted key."""
    if isinstance(grid, dict):
        for k, v in grid.items():
            yield from _grid_lists(v, f"{prefix}{k}.")
    elif isinstance(grid, list) and grid and all(isinstance(x, (int, float)) for x in grid):
        yield prefix.rstrip("."), grid


def write_operator_file(path: str | Path, meta: Mapping[str, object],
                        rows: Iterable[Mapping[str, float | str]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        for key, value in {"format": FORMAT, "time_unit": "s", **meta}.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _cell(row.get(c)) for c in COLUMNS})
    return path


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6e}" if not value.is_integer() or value < 1e-3 else str(int(value))
    return str(value)

