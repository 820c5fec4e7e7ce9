"""The simulator side of a tensor-parallel fidelity run prices the all-reduce path the engine runs
recorded (summary.json's `run.all_reduce`), says so when they recorded none, and lets an explicit
override win; on synthetic engine runs (simulator traces stored as engine runs)."""
from __future__ import annotations

import json

import pytest

from experiments.fidelity import _main
from experiments.lib.fidelity_all_reduce import NCCL_OVERRIDE, SimAllReduce, recorded, sim_all_reduce
from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.run_workload import run

COMMON = ["model=qwen3-8b", "hardware=h200", "parallel.tensor_parallel_size=2", "seed=0", "progress=false",
          "plots=false", "blocks.num_gpu_blocks=2000", "blocks.num_cpu_blocks=0"]
OFFLINE = ["workload=offline", "workload.num_requests=4", "workload.prompt_len.low=16", "workload.prompt_len.high=64",
           "workload.output_len.low=4", "workload.output_len.high=8"]
SPEC = f"""common: {json.dumps(COMMON)}
engine: [backend=engine]
sim: [backend=sim, latency=operators]
warmup: []
capacity: offline
scenarios:
  offline:
    overrides: {json.dumps(OFFLINE)}
ab: []
"""
NCCL_RECORD = {"path": "nccl", "world_size": 2, "reason": "disable_custom_all_reduce is set"}
SYMMETRIC_RECORD = {"path": "symmetric", "world_size": 2, "one_shot_max_bytes": 65536, "two_shot_max_bytes": 2**20}


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


def engine_runs(tmp_path, record: dict | None, name: str = "engine_runs"):
    """A stored --runs dir whose `offline` engine run is a simulator trace with the engine's `run`
    facts: `record` as its all-reduce path (None: a run from before engines recorded it)."""
    out = tmp_path / name / "offline" / "engine"
    run(compose_cfg([*COMMON, *OFFLINE, "backend=sim", "latency=operators"]), out, "engine")
    summary = json.loads((out / "summary.json").read_text())
    summary["run"] = {"backend": "engine", "clock": "wall", "num_gpu_blocks": 2000, "num_cpu_blocks": 0,
                      "device": "NVIDIA H200", "dtype": "bfloat16", "cuda_graphs": True, "decode_kernel": "packed"}
    if record is not None:
        summary["run"]["all_reduce"] = record
    (out / "summary.json").write_text(json.dumps(summary))
    return tmp_path / name


def fidelity(tmp_path, spec, runs, *extra: str):
    fid = _main(["--spec", str(spec), "--engine-runs", str(runs), "--runs", str(tmp_path / "sim_runs"),
                 "--out", str(tmp_path / "report"), *extra])
    priced = fid.results["offline"]["sim"][0]["run"]["latency_data"]["collectives"]
    return fid, priced, (tmp_path / "report" / "fidelity.md").read_text()


def test_engine_runs_that_recorded_nccl_are_priced_on_nccl(tmp_path, spec, capsys):
    fid, priced, report = fidelity(tmp_path, spec, engine_runs(tmp_path, NCCL_RECORD))
    assert fid.all_reduce.overrides == [NCCL_OVERRIDE]
    assert "symmetric memory off: disable_custom_all_reduce is set" in priced
    line = "- all-reduce: the simulator priced NCCL for every message (disable_custom_all_reduce is set), as the engine runs recorded"
    assert line in report
    assert "[fidelity] all-reduce: the simulator priced NCCL" in capsys.readouterr().out


def test_engine_runs_that_recorded_symmetric_paths_are_priced_at_their_thresholds(tmp_path, spec):
    fid, priced, report = fidelity(tmp_path, spec, engine_runs(tmp_path, SYMMETRIC_RECORD))
    assert "parallel.custom_all_reduce_one_shot_max_bytes=65536" in fid.all_reduce.overrides
    assert "one-shot up to 65536 bytes, two-shot up to 1048576" in priced
    assert "two-shot up to 1048576, NCCL above, as the engine runs recorded\n" in report


def test_engine_runs_without_a_record_say_which_path_the_simulator_priced(tmp_path, spec, capsys):
    fid, priced, report = fidelity(tmp_path, spec, engine_runs(tmp_path, None))
    assert fid.all_reduce.overrides == []
    assert "the engine runs did not record their all-reduce path" in report
    assert f"--sim {NCCL_OVERRIDE}" in report
    assert "the simulator priced symmetric-memory one-shot" in report  # the engine's current default
    assert "all-reduce: the engine's paths, one-shot up to" in priced
    assert "did not record their all-reduce path" in capsys.readouterr().out


def test_an_explicit_override_wins_and_the_report_says_so(tmp_path, spec):
    fid, priced, report = fidelity(tmp_path, spec, engine_runs(tmp_path, SYMMETRIC_RECORD), "--sim", NCCL_OVERRIDE)
    assert fid.all_reduce.overrides == []
    assert "symmetric memory off: disable_custom_all_reduce is set" in priced
    assert (f"as the overrides set ({NCCL_OVERRIDE}); the engine runs recorded symmetric-memory one-shot up to "
            "65536 bytes") in report


def test_one_gpu_adds_nothing_and_runs_that_disagree_or_ran_another_size_are_refused():
    one_gpu = [o for o in COMMON if not o.startswith("parallel.")]
    assert sim_all_reduce([{"all_reduce": NCCL_RECORD}], one_gpu, compose_cfg) == SimAllReduce([])
    assert recorded([{}, {}]) is None
    with pytest.raises(ValueError, match="recorded different all-reduce paths"):
        sim_all_reduce([{"all_reduce": NCCL_RECORD}, {}], COMMON, compose_cfg)
    with pytest.raises(ValueError, match="over 4 GPUs, but parallel.tensor_parallel_size=2"):
        sim_all_reduce([{"all_reduce": {**NCCL_RECORD, "world_size": 4}}], COMMON, compose_cfg)


def test_the_recorded_kernels_are_priced_and_a_record_without_them_means_torchs():
    fused = sim_all_reduce([{"all_reduce": {**SYMMETRIC_RECORD, "kernel": "triton_fused"}}], COMMON, compose_cfg)
    assert "parallel.all_reduce_kernel=triton_fused" in fused.overrides
    assert fused.note.endswith("two-shot up to 1048576, NCCL above (triton_fused kernels), as the engine runs recorded")
    # A record leaves torch's kernels out: such runs are priced unfused even where "auto" now fuses.
    torch_ = sim_all_reduce([{"all_reduce": SYMMETRIC_RECORD}], COMMON, compose_cfg)
    assert "parallel.all_reduce_kernel=torch" in torch_.overrides
    assert torch_.note.endswith("two-shot up to 1048576, NCCL above, as the engine runs recorded")
