"""`python -m experiments.run` end to end: files, determinism, multirun, one-line config errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import run as run_module

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["workload.num_requests=30", "progress=false"]


def cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_run_writes_traces_summary_and_plots_deterministically(tmp_path):
    first = cli(*SMALL, f"hydra.run.dir={tmp_path}/one", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    out = tmp_path / "one"
    for name in ("requests.parquet", "steps.parquet", "events.parquet", "summary.json",
                 "kv_blocks.png", "queues.png", "latency_cdf.png", "throughput.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 30 and summary["run"]["policy"] == "fcfs"
    assert summary["config"]["workload"]["num_requests"] == 30
    assert "request throughput (req/s)" in first.stdout and "TTFT mean" in first.stdout
    second = cli(*SMALL, "plots=false", f"hydra.run.dir={tmp_path}/two", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    for name in ("requests.parquet", "steps.parquet", "events.parquet"):
        assert (out / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_multirun_keeps_jobs_apart(tmp_path):
    res = cli("-m", "policy=fcfs,priority", "workload.rate=1,2", "workload.num_requests=5", "plots=false",
              "progress=false", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 4
    seen = set()
    for path in summaries:
        s = json.loads(path.read_text())
        seen.add((s["run"]["policy"], s["config"]["workload"]["rate"]))
        assert s["completed"] == 5
    assert seen == {("fcfs", 1.0), ("fcfs", 2.0), ("priority", 1.0), ("priority", 2.0)}


@pytest.mark.parametrize("override, key", [
    ("policy=lottery", "policy/lottery"),
    ("policy.name=lottery", "policy.name='lottery'"),
    ("workload.rate=-2", "workload.rate=-2"),
    ("blocks.block_size=0", "blocks.block_size=0"),
    ("blocks.num_gpu_blocks=0", "blocks.num_gpu_blocks=0"),
    ("blocks.kv_cache_gib=0.0001", "blocks.kv_cache_gib=0.0001"),
    ("workload.no_such_key=1", "workload.no_such_key"),
    ("latency=profiled model=llama-3.2-1b", "latency.path="),  # no h200 profile for that model
    ("scheduler.max_num_seqs=0", "scheduler.max_num_seqs=0"),
    ("policy.preemption_mode=later", "policy.preemption_mode='later'"),
])
def test_bad_config_is_one_line_naming_the_key(override, key, monkeypatch, capsys, tmp_path):
    expect_one_line_error([*override.split(), *SMALL, f"hydra.run.dir={tmp_path}"], key, monkeypatch, capsys)


def expect_one_line_error(args, key, monkeypatch, capsys):
    """`experiments.run args` exits with code 2 and one line on stderr that holds `key`."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["run", *args])
    with pytest.raises(SystemExit) as exc:
        run_module.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert key in err, err
    assert "HYDRA_FULL_ERROR" not in os.environ  # restored for the rest of the process


def test_default_run_queues_preempts_and_policies_differ(tmp_path):
    """The default config (`make run`) loads the KV pool past what it holds: requests wait, some
    are preempted, and fcfs and priority give the urgent class different first-token times."""
    from hydra import compose, initialize_config_module

    summaries = {}
    for policy in ("fcfs", "priority"):
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"policy={policy}", "progress=false", "plots=false"])
        summaries[policy] = run_module.run(cfg, tmp_path / policy)
    for s in summaries.values():
        assert s["completed"] == s["num_requests"] and s["num_preemptions"] > 0
        assert s["queueing_time"]["p90"] > 0.1  # seconds: requests wait for KV blocks
    urgent = {p: s["per_priority"]["0"]["ttft"]["mean"] for p, s in summaries.items()}
    assert urgent["priority"] < 0.5 * urgent["fcfs"]
