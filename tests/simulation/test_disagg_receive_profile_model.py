"""A KV receive profile prices the model it was measured on (experiments/lib/disagg_backend.py):
the spec's Qwen3-0.6B profile is taken for Qwen3-0.6B and refused, naming the key, for another model."""
import pytest

from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.run_workload import run

PROFILE = "experiments/profiles/kv_receive/h200-qwen3-0.6b.csv"
COMMON = ["backend=sim", "latency=roofline", "hardware=h200", "seed=0", "progress=false", "plots=false",
          "cluster.replicas=2", "cluster.roles=[prefill,decode]", "workload=poisson", "workload.rate=50",
          "workload.num_requests=6", "workload.prompt_len.low=16", "workload.prompt_len.high=32",
          "workload.output_len.low=2", "workload.output_len.high=4", f"cluster.kv_receive_profile={PROFILE}"]


def test_the_profile_prices_its_own_model(tmp_path):
    summary = run(compose_cfg(["model=qwen3-0.6b", *COMMON]), tmp_path)
    assert summary["completed"] == 6 and summary["aborted"] == 0


def test_another_models_run_refuses_it(tmp_path):
    with pytest.raises(ValueError, match=r"cluster.kv_receive_profile=.*was measured on model 'qwen3-0.6b', and "
                                         r"this run's decode replicas run 'llama-3.2-1b'"):
        run(compose_cfg(["model=llama-3.2-1b", *COMMON]), tmp_path)
