"""Every Hydra entry point's run directory is its own: `${fresh_run_dir:outputs/x}`
(experiments/lib/run_dirs.py) claims outputs/x/<date>/<time>, or <time>-2, ... when runs start in
the same second (two sweeps in parallel used to write into one directory, the later files over the
earlier)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import yaml
from omegaconf import OmegaConf

import experiments  # noqa: F401 (registers the resolvers)
from experiments.lib.paths import REPO_ROOT


def test_each_config_claims_a_directory_of_its_own_and_keeps_it(tmp_path, monkeypatch):
    import datetime as dt

    from experiments.lib import run_dirs

    class SameSecond(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 11, 28, 19, 15, 24)

    monkeypatch.setattr(run_dirs, "dt", SimpleNamespace(datetime=SameSecond))
    configs = [OmegaConf.create({"run_dir": "${fresh_run_dir:" + str(tmp_path / "x") + "}"}) for _ in range(3)]
    dirs = [Path(c.run_dir) for c in configs]
    assert len(set(dirs)) == 3 and all(d.is_dir() and d.parent.parent == tmp_path / "x" for d in dirs)
    assert [d.relative_to(tmp_path / "x").as_posix() for d in dirs] == [
        "2026-11-28/19-15-24", "2026-11-28/19-15-24-2", "2026-11-28/19-15-24-3"]
    assert [Path(c.run_dir) for c in configs] == dirs  # resolved again: the same directory, none new
    assert len(list((tmp_path / "x").glob("*/*"))) == 3


def test_every_entry_points_run_dir_uses_it():
    for name in ("config", "search", "disagg_sweep", "profile"):
        run_dir = yaml.safe_load((REPO_ROOT / "conf" / f"{name}.yaml").read_text())["hydra"]["run"]["dir"]
        assert run_dir.startswith("${fresh_run_dir:outputs"), (name, run_dir)
