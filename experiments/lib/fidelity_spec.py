"""The fidelity experiment's scenario file (conf/fidelity/*.yaml) and Hydra composition of run configs."""
from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

from experiments.lib.config_schema import check_fidelity_spec
from experiments.lib.paths import REPO_ROOT, resolve_path
from sim.latency.file_meta import text_lines

DEFAULT_SPEC = REPO_ROOT / "conf" / "fidelity" / "default.yaml"


def load_spec(path: str | Path) -> dict[str, Any]:
    """The spec at `path`; one with `extends: other.yaml` is that spec (a path relative to this
    one's folder) with this one's keys replacing its own."""
    path = resolve_path(path)
    if not Path(path).is_file():
        raise ValueError(f"--spec={str(path)!r} is invalid: no such file")
    spec = OmegaConf.to_container(_load_yaml(Path(path)), resolve=True)
    if not isinstance(spec, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
            f"spec {path} is invalid: its top level is a {type(spec).__name__}, not a mapping of keys "
            "(common, engine, sim, scenarios, ...: conf/fidelity/default.yaml is an example)")
    check_fidelity_spec(spec, path)
    if spec.get("extends"):
        base_path = Path(path).parent / spec["extends"]
        if not base_path.is_file():
            raise ValueError(f"spec {path}: extends={spec['extends']!r} is invalid: no such file {base_path}")
        spec = {**load_spec(base_path), **{k: v for k, v in spec.items() if k != "extends"}}
    for key in ("common", "engine", "sim", "scenarios"):
        if key not in spec:
            raise ValueError(f"spec {path}: key {key!r} is missing")
    for name, scn in spec["scenarios"].items():
        if not isinstance(scn, dict) or not isinstance(scn.get("overrides", []), list):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                f"spec {path}: scenarios.{name} must be a mapping with an `overrides` list")
        load = scn.get("load")
        if load is not None and (not isinstance(load, (int, float)) or load <= 0):
            raise ValueError(f"spec {path}: scenarios.{name}.load={load!r} is invalid: must be a number > 0")
        if load is not None and spec.get("capacity") not in spec["scenarios"]:
            raise ValueError(f"spec {path}: capacity={spec.get('capacity')!r} must name a scenario "
                             f"(scenarios.{name} has a load)")
    if spec.get("goodput") is not None:
        from experiments.lib.fidelity_goodput import GoodputSpec
        GoodputSpec.parse(spec["goodput"], spec["scenarios"], str(path))
    return spec


def _load_yaml(path: Path):
    """The file's YAML; text that is not UTF-8 names the file, the line and the byte (read by
    text_lines, as trace and profile files are), and a syntax error the file, the line and what the
    parser expected."""
    try:
        text = "".join(line + "\n" for line in text_lines(path))
    except ValueError as e:
        raise ValueError(f"spec {e}") from None
    try:
        return OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None) or str(e).splitlines()[0]
        context, opened = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context:
            elsewhere = opened is not None and (mark is None or opened.line != mark.line)
            problem += f" ({context}{f' from line {opened.line + 1}' if elsewhere else ''})"
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ValueError(f"spec {where}: not valid YAML: {problem}") from None


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def check_overridden(overrides: Sequence[str], spec: dict[str, Any], spec_path: str) -> None:
    """A positional override goes before the spec's per-side and per-scenario lists, so a key that
    one of those also sets would silently lose: refused, naming the key and where it is set."""
    later = [(f"its {side} list", spec.get(side) or []) for side in ("engine", "sim")]
    later += [(f"scenario {name}'s overrides", (scn or {}).get("overrides") or [])
              for name, scn in spec["scenarios"].items()]
    for override in overrides:
        key = _override_key(override)
        for where, items in later:
            if any(_override_key(str(item)) == key for item in items):
                side = "--sim (the simulator side)" if where == "its sim list" else "a spec of your own"
                raise ValueError(f"override {override!r}: {spec_path} sets {key} in {where}, which comes after "
                                 f"the command line's overrides and would win; pass it with {side}")


def select_scenarios(spec: dict[str, Any], scenarios: str | None) -> list[str]:
    """`--scenarios a,b` (None or empty: all) as the spec's scenario names, in the order the spec
    runs them; a name the spec lacks is refused."""
    names = list(spec["scenarios"])
    if not scenarios:
        return names
    wanted = scenarios.split(",")
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise ValueError(f"--scenarios={scenarios!r} is invalid: {unknown} not in {names}")
    return [n for n in names if n in wanted]


def compose_cfg(overrides: Sequence[str]) -> DictConfig:
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def server_overrides(overrides: Sequence[str]) -> list[str]:
    """`overrides` with backend=server first unless they pick another backend."""
    return list(overrides) if any(o.startswith("backend=") for o in overrides) else ["backend=server", *overrides]


def compose_server_cfg(overrides: Sequence[str]) -> DictConfig:
    """conf/config.yaml with backend=server unless the overrides pick another backend."""
    return compose_cfg(server_overrides(overrides))
