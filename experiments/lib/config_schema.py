"""Checks every config group (conf/<group>/*.yaml) and the top-level files (conf/config.yaml,
conf/profile.yaml, a fidelity spec) against their schemas (the keys each may hold and their types,
as OmegaConf structured configs). Hydra catches a mistyped key on the command line but not in a
yaml file, where it would be silently ignored; `check_config` refuses it with a ValueError naming
the file and the key, and `unknown_override` words Hydra's refusal of a command-line key alike.

A pluggable group's schema is the config dataclass of the plugin its file names (policies,
block managers, latency models, backends, workloads: every registry with a `group`,
policies/registry.py: CONFIG_GROUPS), so a plugin's new knob is checked with no edit here. The
groups that are no plugin's (model, hardware, profile_grid, operator_grid, cluster) have one schema each.
Values are checked for type only; ranges and meanings stay with the code that reads them
(the plugins, factory), whose messages name the key too.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import experiments.lib.backends
import experiments.lib.workloads  # noqa: F401
import policies.blocks
import policies.policy
import policies.routing  # noqa: F401
import sim.latency  # noqa: F401
from experiments.lib.config_groups import Cluster, FidelitySpec, Parallel, Serving, Slo
from experiments.lib.paths import REPO_ROOT
from experiments.lib.profiling.grid import ProfileGrid
from experiments.lib.profiling.operator_grid import OperatorGrid
from policies.model_shape import ModelShape
from policies.registry import CONFIG_GROUPS
from policies.scheduler_config import SchedulerConfig
from sim.latency import Hardware

CONF_DIR = REPO_ROOT / "conf"
# The groups that are no plugin's: one schema each.
SINGLE_SCHEMA_GROUPS: dict[str, type] = {"hardware": Hardware, "model": ModelShape, "profile_grid": ProfileGrid,
                                         "operator_grid": OperatorGrid, "cluster": Cluster}


def group_schema(group: str, section: Mapping[str, Any]) -> type | None:
    """The schema a `group` section follows: its plugin's config, picked by the registry's key
    (None for an unknown plugin: the builder says so, naming the allowed ones)."""
    if group in SINGLE_SCHEMA_GROUPS:
        return SINGLE_SCHEMA_GROUPS[group]
    registry = CONFIG_GROUPS[group]
    name = section.get(registry.key)
    return registry.config_type(name) if name in registry else None


def groups() -> list[str]:
    return [*CONFIG_GROUPS, *SINGLE_SCHEMA_GROUPS]
# The top-level files: their own keys' schemas (None: any value) and the groups they compose.
RUN_KEYS: dict[str, type | None] = {"seed": int, "scheduler": SchedulerConfig, "slo": Slo, "progress": bool,
                                    "parallel": Parallel, "serving": Serving,
                                    "plots": bool}
PROFILE_KEYS: dict[str, type | None] = {
    "device": str | None, "gpu": str | None, "dtype": str | None, "block_size": int,
    "max_num_batched_tokens": int, "max_num_seqs": int, "max_model_len": int, "enforce_eager": bool,
    "decode_kernel": str, "async_scheduling": bool, "warmup": int, "repeats": int, "passes": int,
    "host_repeats": int, "seed": int, "progress": bool, "out": str | None, "calibrate": bool,
    "tensor_parallel_size": int,
    "calibrated_out": str | None, "mode": str, "operator_parts": list, "operators_dir": str | None}


def check_config(cfg: Mapping[str, Any], top: str = "config", choices: Mapping[str, str] | None = None,
                 overrides: Sequence[str] = (), search: Sequence[Path] = ()) -> None:
    """Refuse an unknown or mistyped key anywhere in a composed config (`top`: the file it was
    composed from, "config" or "profile"). `choices` (Hydra's runtime choices: group -> file name),
    `overrides` (the command line) and `search` (config directories besides conf/) tell where a key
    came from; without them the group's files holding the key are named."""
    data = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg
    own = RUN_KEYS if top == "config" else PROFILE_KEYS
    origin = _Origin(top, choices, overrides, [*search, CONF_DIR])
    for key, value in data.items():
        if key in groups():
            schema = group_schema(key, value) if isinstance(value, Mapping) else None
            if schema is not None:
                _check(value, schema, key, origin)
        elif key not in own:
            raise ValueError(f"{origin.where(None, [key])}: key {key} is unknown: allowed are "
                             f"{sorted([*own, *(g for g in groups() if g in data)])}")
        elif dataclasses.is_dataclass(own[key]) and isinstance(value, Mapping):
            _check(value, own[key], key, origin)
        elif own[key] is not None:
            _check_value(value, own[key], key, origin)


def hydra_origin() -> tuple[dict[str, str] | None, list[str], list[Path]]:
    """(choices, command-line overrides, config directories) of the running Hydra app, or nothing
    outside one."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None, [], []
    hc = HydraConfig.get()
    dirs = [Path(src.path) for src in hc.runtime.config_sources if src.schema == "file"]
    return {k: str(v) for k, v in hc.runtime.choices.items()}, list(hc.overrides.task), dirs


def check_fidelity_spec(spec: Mapping[str, Any], path: Path | str) -> None:
    _check(spec, FidelitySpec, None, _Origin(None, None, (), [], file=str(path)))


@dataclass(slots=True)
class _Origin:
    top: str | None
    choices: Mapping[str, str] | None
    overrides: Sequence[str]
    dirs: Sequence[Path]  # config directories, searched in order
    file: str | None = None

    def where(self, group: str | None, path: list[str]) -> str:
        """The file (or the command line) a key at `group.path` came from."""
        if self.file is not None:
            return self.file
        dotted = ".".join([*([group] if group else []), *path])
        typed = [o for o in self.overrides if o.lstrip("+~").split("=")[0] == dotted]
        if typed:  # a key given twice holds its last value
            return f"the command line ({typed[-1]})"
        if group is None:
            return _rel(CONF_DIR / f"{self.top}.yaml")
        choice = (self.choices or {}).get(group)
        for d in self.dirs:
            if (d / group / f"{choice}.yaml").is_file() and _holds(d / group / f"{choice}.yaml", path):
                return _rel(d / group / f"{choice}.yaml")
        holding = [p for d in self.dirs for p in sorted((d / group).glob("*.yaml")) if _holds(p, path)]
        return ", ".join(_rel(p) for p in holding) or f"the {group} config"


def _check(section: Mapping[str, Any], schema: type, group: str | None, origin: _Origin,
           path: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(schema)
    for key, value in section.items():
        at = [*path, str(key)]
        if key not in hints or key not in {f.name for f in dataclasses.fields(schema)}:
            dotted = ".".join([*([group] if group else []), *at])
            raise ValueError(_unknown_key(origin.where(group, at), dotted, _field_names(schema)))
        inner = _strip_optional(hints[key])
        if dataclasses.is_dataclass(inner) and isinstance(value, Mapping):
            _check(value, inner, group, origin, tuple(at))
        elif typing.get_origin(inner) is dict and isinstance(value, Mapping):
            item = typing.get_args(inner)[1]
            if dataclasses.is_dataclass(item):
                for name, entry in value.items():
                    if isinstance(entry, Mapping):
                        _check(entry, item, group, origin, (*at, str(name)))
    try:
        OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.create(dict(section)))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        dotted = ".".join(p for p in [group, *path, key] if p)
        where = origin.where(group, [*path, *key.split('.')])
        shape = _container_kind(hints.get(key.split(".")[0]), section.get(key.split(".")[0]))
        if shape is not None:  # OmegaConf's words for it ("AnyNode is not a ListConfig") name no key
            raise ValueError(f"{where}: {dotted}={section.get(key.split('.')[0])!r} is invalid: {shape}") from None
        raise ValueError(f"{where}: {dotted} is invalid: {str(e).splitlines()[0]}") from None


def _unknown_key(where: str, dotted: str, allowed: list[str]) -> str:
    return f"{where}: key {dotted} is unknown: allowed are {allowed}"


def _field_names(schema: type) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(schema))


def unknown_override(exc: BaseException) -> str | None:
    """Hydra's refusal of a command-line override of a key the composed config lacks (`cluster.foo=1`:
    "Could not override 'cluster.foo'", "Key 'foo' is not in struct") in `check_config`'s words for
    a yaml file's unknown key, naming the keys allowed there (its schema's, else the config's); a
    key the schema has but the chosen file leaves out is added with `+`. None for another error."""
    cause = exc.__cause__
    full_key, parent = getattr(cause, "full_key", None), getattr(cause, "parent_node", None)
    if not isinstance(cause, OmegaConfBaseException) or "not in struct" not in str(cause) or not full_key \
            or parent is None:
        return None
    typed = re.search(r"use \+(\S+)", str(exc))  # Hydra's advice repeats the override
    override = typed.group(1) if typed else full_key
    *path, key = full_key.split(".")
    schema, present = _schema_at(path, parent), sorted(str(k) for k in parent if k != "hydra")
    if schema is None:
        return _unknown_key(f"the command line ({override})", full_key, present)
    if key in _field_names(schema):
        return (f"the command line ({override}): key {full_key} is not in the chosen {path[0]} config (its keys: "
                f"{present}): add it with +{override}")
    return _unknown_key(f"the command line ({override})", full_key, _field_names(schema))


def _schema_at(path: list[str], parent: Any) -> type | None:
    """The schema of the config section at `path` (`parent`: that section's node), or None where
    none is known (the top level, a section no schema covers)."""
    if not path:
        return None
    root = parent._get_root()
    group = path[0]
    section = OmegaConf.to_container(root[group], resolve=False) if group in root else {}
    if group in groups():
        schema = group_schema(group, section)
    else:
        schema = RUN_KEYS.get(group) if dataclasses.is_dataclass(RUN_KEYS.get(group)) else None
    for key in path[1:]:
        if schema is None or key not in _field_names(schema):
            return None
        inner = _strip_optional(typing.get_type_hints(schema)[key])
        schema = inner if dataclasses.is_dataclass(inner) else None
    return schema


def _container_kind(annotation: Any, value: Any) -> str | None:
    """What a list- or mapping-typed key must hold, when `value` is not one (None otherwise)."""
    if annotation is None:
        return None
    inner = _strip_optional(annotation)
    null = ", or null" if inner is not annotation else ""
    if typing.get_origin(inner) in (list, tuple, Sequence) and not isinstance(value, (list, tuple)):
        return f"must be a list ([a, b]){null}"
    if (typing.get_origin(inner) is dict or dataclasses.is_dataclass(inner)) and not isinstance(value, Mapping):
        return f"must be a mapping ({{key: value}}){null}"
    return None


def _check_value(value: Any, kind: Any, key: str, origin: _Origin) -> None:
    _check({key: value}, dataclasses.make_dataclass("Value", [(key, kind)]), None, origin)


def _strip_optional(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _holds(path: Path, keys: list[str]) -> bool:
    node: Any = yaml.safe_load(path.read_text()) or {}
    for key in keys:
        if not isinstance(node, Mapping) or key not in node:
            return False
        node = node[key]
    return True


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)
