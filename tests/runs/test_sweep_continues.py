"""A sweep (`experiments.run -m`) with a job whose config is bad: the job's error is printed naming
its number and overrides and kept in its run directory's error.txt, the jobs after it still run,
and the sweep ends with exit code 2 and the list of failed jobs; on the basic launcher (in this
process) and on the joblib launcher's worker processes alike."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import run as run_module

ROOT = Path(__file__).resolve().parents[2]
RATES = ["-m", "workload=poisson", "workload.num_requests=5", "progress=False", "plots=False"]
RATE_ERROR = "workload.rate=-1 is invalid: must be a finite number > 0"


def _jobs(sweep_dir: Path) -> dict[int, Path]:
    return {int(p.name.split("_")[0]): p for p in sweep_dir.iterdir() if p.is_dir()}


def _sweep_in_process(args: list[str], monkeypatch) -> int | None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["run", *args])
    try:
        run_module.main()
    except SystemExit as exc:
        return exc.code
    return None


def test_a_bad_job_does_not_stop_the_sweep(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    code = _sweep_in_process([*RATES, "workload.rate=10,-1,20", f"hydra.sweep.dir={out}"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    jobs = _jobs(out)
    assert sorted(jobs) == [0, 1, 2]
    assert (jobs[0] / "summary.json").is_file() and (jobs[2] / "summary.json").is_file()  # the job after it ran
    assert not (jobs[1] / "summary.json").exists()
    line = (jobs[1] / "error.txt").read_text().splitlines()[0]
    assert line == f"job 1 ({' '.join(RATES[1:])} workload.rate=-1): {RATE_ERROR}"
    assert f"error: {line}" in err  # printed when the job failed
    summary = err[err.index("error: 1 job(s) of the sweep failed"):].splitlines()
    assert summary[1:] == [f"  {line}"], summary
    assert not (jobs[0] / "error.txt").exists() and not (jobs[2] / "error.txt").exists()

    # Into the same directory again: the earlier sweep's error is no failure of this one.
    code = _sweep_in_process([*RATES, "workload.rate=10,-2", f"hydra.sweep.dir={out}"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and (jobs[1] / "error.txt").is_file()  # still there, but not listed below
    summary = err[err.index("error: 1 job(s) of the sweep failed"):].splitlines()
    assert len(summary) == 2 and "workload.rate=-2 is invalid" in summary[1], summary


def test_a_run_directory_reused_by_a_good_job_loses_its_old_error(tmp_path, monkeypatch, capsys):
    numbered = [f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=${hydra.job.num}"]  # job 1's directory reused
    assert _sweep_in_process([*RATES, "workload.rate=10,-1", *numbered], monkeypatch) == 2
    assert (tmp_path / "1" / "error.txt").is_file()
    assert _sweep_in_process([*RATES, "workload.rate=10,30", *numbered], monkeypatch) is None, capsys.readouterr().err
    assert not (tmp_path / "1" / "error.txt").exists() and (tmp_path / "1" / "summary.json").is_file()


def test_full_error_still_raises_the_job_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["run", *RATES, "workload.rate=-1", f"hydra.sweep.dir={tmp_path}"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="workload.rate=-1 is invalid"):
        run_module.main()


def test_joblib_workers_go_on_and_the_sweep_lists_every_failure(tmp_path):
    out = tmp_path / "sweep"
    res = subprocess.run([sys.executable, "-m", "experiments.run", *RATES, "workload.rate=-1,10,-2",
                          "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={out}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                         env={**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"},
                              "PYTHONPATH": str(ROOT)})
    assert res.returncode == 2, res.stderr
    jobs = _jobs(out)
    assert (jobs[1] / "summary.json").is_file()
    failed = [(jobs[n] / "error.txt").read_text().splitlines()[0] for n in (0, 2)]
    assert "workload.rate=-2 is invalid" in failed[1]
    summary = res.stderr[res.stderr.index("error: 2 job(s) of the sweep failed"):].splitlines()
    assert summary[1:] == [f"  {line}" for line in failed], res.stderr
    assert "Traceback" not in res.stderr
