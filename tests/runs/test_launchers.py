"""Sweeps through Hydra's launcher plugins: the joblib launcher (two worker processes) gives the
same runs, byte for byte, as the sequential basic launcher, and the trace loader (the notebook's)
reads a sweep directory whatever launcher wrote it."""
import json
import os
import subprocess
import sys
from pathlib import Path

from experiments.lib.traces import load_runs

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ("-m", "policy=fcfs,priority", "workload.rate=20,40", "workload.num_requests=30", "plots=false",
         "progress=false")


def sweep(tmp_path: Path, name: str, *launcher: str) -> Path:
    out = tmp_path / name
    res = subprocess.run([sys.executable, "-m", "experiments.run", *SWEEP, *launcher, f"hydra.sweep.dir={out}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    return out


def test_joblib_sweep_equals_the_sequential_one(tmp_path):
    basic = sweep(tmp_path, "basic")
    joblib = sweep(tmp_path, "joblib", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    jobs = sorted(p.name for p in basic.iterdir() if p.is_dir())
    assert len(jobs) == 4 and jobs == sorted(p.name for p in joblib.iterdir() if p.is_dir())
    for job in jobs:
        for name in ("requests.parquet", "steps.parquet", "events.parquet"):
            assert (basic / job / name).read_bytes() == (joblib / job / name).read_bytes(), (job, name)
        a, b = (json.loads((d / job / "summary.json").read_text()) for d in (basic, joblib))
        a["run"].pop("wall_time_s"), b["run"].pop("wall_time_s")
        assert a == b
    # A cluster launcher's bookkeeping (submitit's .submitit/<job id>/ pickles and logs) is no run.
    (joblib / ".submitit" / "123_0").mkdir(parents=True)
    (joblib / ".submitit" / "123_0" / "123_0_result.pkl").write_bytes(b"\x80\x04N.")
    runs = load_runs(joblib)
    assert sorted(run.path.name for run in runs) == jobs
