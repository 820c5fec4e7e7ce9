"""The breakdown tool: a simulated run's priced seconds by operator family and step kind."""
import pandas as pd
import pytest

from experiments.lab.operator_breakdown import breakdown
from sim.latency.operators import OperatorModel

TINY = ["model=tiny-qwen3", "hardware=h200", "latency.gpu=cpu", "latency.dtype=float32", "workload=offline",
        "workload.num_requests=6", "seed=0", "scheduler.max_model_len=2048"]


def test_the_families_add_up_to_the_steps_the_run_priced(tmp_path):
    shape_time = OperatorModel.shape_time
    summary, table = breakdown(TINY, tmp_path)
    assert OperatorModel.shape_time is shape_time  # the model is left as it was
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    kinds = {"steps with prefill": steps.num_prefill_tokens > 0, "decode-only steps": steps.num_prefill_tokens == 0}
    for kind, rows in kinds.items():
        # A step's time is its shape's price, plus the host's when it was not scheduled ahead.
        host = summary["config"]["latency"]["sync_host_s"]
        assert table.loc["total", kind] == pytest.approx(steps.duration[rows].sum(), abs=host * len(steps) + 1e-9)
        assert table.loc["gemm", kind] > 0
    assert table.loc["total", "all steps"] == pytest.approx(table.loc["total", list(kinds)].sum())
    assert summary["completed"] == 6
