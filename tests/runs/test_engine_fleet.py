"""`backend=engine cluster.replicas=2` on CPU: two engine replica processes behind the run's router
write the simulated fleet's trace files (a `replica` column, every request once, arrival times
honoured); round robin sends each request where the simulator sends it; the kept replicas serve a
second run; a bad cluster key is one line."""
from __future__ import annotations

import pandas as pd
import pytest

from experiments.lib import engine_fleet
from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.run_workload import run

FLEET = ["backend=engine", "model=tiny-qwen3", "backend.device=cpu", "blocks=prefix", "blocks.num_gpu_blocks=128",
         "blocks.swap_space_gib=0.01", "scheduler.max_model_len=256", "progress=false", "plots=false",
         "cluster.replicas=2", "workload=system_prompts", "workload.num_requests=10", "workload.rate=50",
         "workload.system_prompts.len=48", "workload.prompt_len.max=24", "workload.output_len.max=6",
         "workload.vocab_size=200"]


@pytest.fixture(scope="module", autouse=True)
def stop_replicas():
    yield
    engine_fleet.release_fleet()


def test_engine_fleet_writes_fleet_traces_routed_as_the_simulator(tmp_path):
    cfg = compose_cfg([*FLEET, "router=round_robin"])
    summary = run(cfg, tmp_path / "engine", "engine")
    sim_overrides = [o for o in FLEET if not o.startswith("backend")]
    run(compose_cfg([*sim_overrides, "router=round_robin", "backend=sim"]), tmp_path / "sim", "sim")
    assert summary["completed"] == 10 and summary["run"]["clock"] == "wall"
    assert summary["run"]["replicas"] == 2 and summary["run"]["router"] == "round_robin"
    assert [r["num_routed"] for r in summary["run"]["replica_info"]] == [5, 5]
    got = pd.read_parquet(tmp_path / "engine" / "requests.parquet").set_index("request_id")
    want = pd.read_parquet(tmp_path / "sim" / "requests.parquet").set_index("request_id")
    assert got.index.is_unique and len(got) == 10
    assert got["replica"].sort_index().tolist() == want["replica"].sort_index().tolist()
    assert (got["arrival_time"].sort_index() - want["arrival_time"].sort_index()).abs().max() < 1e-9
    assert (got["first_scheduled_time"] >= got["arrival_time"]).all()
    steps = pd.read_parquet(tmp_path / "engine" / "steps.parquet")
    assert set(steps["replica"]) == {0, 1}
    assert set(summary["per_replica"]) == {"0", "1"}


def test_kept_replicas_serve_a_second_run_with_another_router(tmp_path):
    summary = run(compose_cfg([*FLEET, "router=prefix_aware"]), tmp_path, "engine")
    assert summary["completed"] == 10 and summary["run"]["router"] == "prefix_aware"
    assert len(engine_fleet._FLEET) == 1


def test_cluster_hardware_is_refused_on_the_engine(tmp_path):
    with pytest.raises(ValueError, match=r"^cluster.hardware=\['h200', 'h200'\] is invalid with backend=engine"):
        run(compose_cfg([*FLEET, "cluster.hardware=[h200,h200]"]), tmp_path, "engine")
