"""Which all-reduce the simulator side of a fidelity run prices under tensor parallelism: the path
the engine runs took, as they recorded it (summary.json's `run.all_reduce`, written from the
engine's group: `engine.distributed.all_reduce_path.AllReducePath`), not the one the engine's
current defaults would take, which may have changed since the runs.

- recorded NCCL for every message: the simulator prices NCCL (`parallel.disable_custom_all_reduce=true`);
- recorded symmetric-memory paths: the simulator prices them at the recorded thresholds and with the
  recorded kernels (`kernel`; none recorded: torch's, which a record leaves out), so a run of the
  fused boundary ("triton_fused") is priced fused and a run of torch's kernels is not;
- no record (runs taken before engines recorded it): the simulator prices the current defaults'
  path, and the report and the console say so and how to choose another;
- a run override that sets an all-reduce setting (`parallel.disable_custom_all_reduce`, ...) wins,
  and the report says so.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from experiments.lib import factory
from sim.latency.build import EngineAllReduce

SETTINGS = tuple(f"parallel.{key}" for key in factory.ALL_REDUCE_SETTINGS)
NCCL_OVERRIDE = "parallel.disable_custom_all_reduce=true"


@dataclass(slots=True, frozen=True)
class SimAllReduce:
    """What the simulator side adds to its overrides, and the report's line on it (None: one GPU)."""

    overrides: list[str]
    note: str | None = None


def recorded(runs: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The all-reduce path the engine runs (their summaries' `run` sections) recorded, or None if
    none did; runs that recorded different paths, or some a path and some none, are refused."""
    paths = {json.dumps(run.get("all_reduce"), sort_keys=True) for run in runs}
    if len(paths) > 1:
        raise ValueError(f"the engine runs recorded different all-reduce paths ({sorted(paths)}): compare runs of "
                         f"one engine setting, or set it for the simulator side (--sim {NCCL_OVERRIDE}, ...)")
    return json.loads(paths.pop()) if paths else None


def describe_record(record: Mapping[str, Any]) -> str:
    if record.get("path") == "nccl":
        return f"NCCL for every message ({record.get('reason')})"
    kernel = record.get("kernel", "torch")
    return (f"symmetric-memory one-shot up to {record['one_shot_max_bytes']} bytes, two-shot up to "
            f"{record['two_shot_max_bytes']}, NCCL above" + ("" if kernel == "torch" else f" ({kernel} kernels)"))


def describe_priced(engine: EngineAllReduce) -> str:
    if engine.off_reason is not None:
        return describe_record({"path": "nccl", "reason": engine.off_reason})
    return describe_record({"path": "symmetric", "one_shot_max_bytes": engine.one_shot_max_bytes,
                            "two_shot_max_bytes": engine.two_shot_max_bytes, "kernel": engine.kernel})


def explicit_settings(overrides: Sequence[str]) -> list[str]:
    """The overrides that set an all-reduce setting themselves."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in SETTINGS]


def record_overrides(record: Mapping[str, Any]) -> list[str]:
    """The `parallel` overrides under which the engine's rule picks the recorded path."""
    if record.get("path") == "nccl":
        return [NCCL_OVERRIDE]
    if record.get("path") != "symmetric":
        raise ValueError(f"run.all_reduce.path={record.get('path')!r} is invalid: 'nccl' or 'symmetric'")
    return ["parallel.disable_custom_all_reduce=false",
            f"parallel.custom_all_reduce_one_shot_max_bytes={int(record['one_shot_max_bytes'])}",
            f"parallel.custom_all_reduce_max_bytes={int(record['two_shot_max_bytes'])}",
            f"parallel.all_reduce_kernel={record.get('kernel', 'torch')}"]


def sim_all_reduce(runs: Sequence[Mapping[str, Any]], overrides: Sequence[str], compose) -> SimAllReduce:
    """The simulator side's all-reduce for engine runs `runs` (their `run` sections), whose own
    overrides are `overrides` (common, scenario and simulator lists); `compose(overrides)`: the
    run config."""
    cfg = compose(list(overrides))
    size = factory.tensor_parallel_size(cfg)
    if size == 1:
        return SimAllReduce([])
    explicit = explicit_settings(overrides)
    if explicit:
        ran = _ran(runs)
        return SimAllReduce([], f"the simulator priced {_priced(cfg)}, as the overrides set ({', '.join(explicit)}); "
                                f"the engine runs recorded {ran}")
    record = recorded(runs)
    if record is None:
        return SimAllReduce([], f"the simulator priced {_priced(cfg)} (the engine's current defaults); the engine "
                                f"runs did not record their all-reduce path (taken before engines recorded it; "
                                f"those before the symmetric-memory default ran NCCL only): pass "
                                f"--sim {NCCL_OVERRIDE} to price NCCL, or set parallel.custom_all_reduce_* thresholds")
    if record.get("world_size") not in (None, size):
        raise ValueError(f"the engine runs recorded an all-reduce over {record['world_size']} GPUs, but "
                         f"parallel.tensor_parallel_size={size}: compare runs of one tensor-parallel size")
    added = record_overrides(record)
    priced = factory.engine_all_reduce(compose([*overrides, *added]))
    note = f"the simulator priced {describe_priced(priced)}, as the engine runs recorded"
    if record["path"] == "symmetric" and (priced.off_reason is not None or (
            priced.one_shot_max_bytes, priced.two_shot_max_bytes, priced.kernel)
            != (record["one_shot_max_bytes"], record["two_shot_max_bytes"], record.get("kernel", "torch"))):
        note += f" {describe_record(record)}, which the simulator's settings do not reproduce"
    return SimAllReduce(added, note)


def _priced(cfg: DictConfig) -> str:
    return describe_priced(factory.engine_all_reduce(cfg))


def _ran(runs: Sequence[Mapping[str, Any]]) -> str:
    try:
        record = recorded(runs)
    except ValueError:
        return "different paths"
    return describe_record(record) if record else "no path (they predate the record)"
