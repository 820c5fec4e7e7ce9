"""Bad values of the run config's own sections (scheduler, slo, parallel, blocks, latency) on the
simulator's path: one line naming the key, the value and what is allowed, exit code 2, the same
rule wherever another entry point (the engine, experiments.search) checks the same value."""
from __future__ import annotations

import re

import pytest
from test_bad_input_run import cli_error

SMALL = ["workload.num_requests=5"]


@pytest.mark.parametrize("overrides, match", [
    (["scheduler.max_model_len=100000000"],
     r"scheduler.max_model_len=100000000 is invalid: model=qwen3-0.6b supports at most max_position_embeddings=40960"),
    (["model=tiny-qwen3"], r"scheduler.max_model_len=4096 is invalid: model=tiny-qwen3 supports at most "
                           r"max_position_embeddings=2048"),
    (["slo.ttft_s=-1"], r"slo.ttft_s=-1 is invalid: must be a number > 0 \(seconds\) or null"),
    (["slo.tpot_s=0"], r"slo.tpot_s=0 is invalid: must be a number > 0 \(seconds\) or null"),
    (["slo.e2el_s=inf"], r"slo.e2el_s=inf is invalid: must be a number > 0 \(seconds\) or null"),
])
def test_bad_value_is_one_line(overrides, match, monkeypatch, capsys):
    err = cli_error([*SMALL, *overrides], monkeypatch, capsys)
    assert re.search(match, err), err


def test_max_model_len_up_to_the_model_positions_runs(tmp_path):
    from experiments.lib.fidelity_spec import compose_cfg
    from experiments.lib.run_workload import run

    summary = run(compose_cfg([*SMALL, "progress=false", "plots=false", "scheduler.max_model_len=40960"]), tmp_path)
    assert summary["completed"] == 5


def test_the_fidelity_goodput_slos_follow_the_run_slo_rule():
    from experiments.lib.fidelity_goodput import GoodputSpec

    section = {"slos": {"tight": {"ttft_s": 1.0, "tpot_s": -0.01}}, "comparisons": {"c": {"split": "a", "mixed": "b"}}}
    with pytest.raises(ValueError, match=r"spec s.yaml: goodput.slos.tight.tpot_s=-0.01 is invalid: must be a "
                                         r"number > 0 \(seconds\) or null"):
        GoodputSpec.parse(section, {"a": {}, "b": {}}, "s.yaml")
