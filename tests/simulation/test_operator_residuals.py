"""The residual tool's step contexts: which step read how many KV entries, from requests' token times."""
import numpy as np
import pandas as pd
import pytest

from experiments.lab.operator_residuals import by_batch, step_contexts, totals


def test_each_token_after_the_first_is_charged_to_its_step_at_prompt_plus_k():
    steps = np.array([0.1, 0.2, 0.3, 0.4])
    # request A: prompt 10, first token at step 0, then steps 1, 2; request B: prompt 100, first at step 1, then 2, 3
    total, longest = step_contexts(steps, [10, 100], [[0.1, 0.2, 0.3], [0.2, 0.3, 0.4]])
    assert total.tolist() == [0, 11, 12 + 101, 102]
    assert longest.tolist() == [0, 11, 101, 102]


def test_a_token_recorded_after_the_last_step_goes_to_the_last_step():
    total, longest = step_contexts(np.array([0.1, 0.2]), [5], [[0.1, 0.2, 0.25]])
    assert total.tolist() == [0, 6 + 7] and longest.tolist() == [0, 7]


def test_by_batch_gives_the_engine_minus_model_residual_per_bin():
    table = pd.DataFrame({"num_decode_seqs": [1, 2, 100], "duration": [1e-3, 3e-3, 5e-3],
                          "model_s": [1e-3, 2e-3, 4e-3], "attention_s": [0.0, 0.0, 1e-3], "hiccup_s": 0.0})
    g = by_batch(table)
    assert g.steps.tolist() == [2, 1]
    assert g.residual_us.tolist() == [500.0, 1000.0]
    assert g.error_pct.iloc[1] == -20.0


def test_by_batch_gives_the_residual_without_the_host_hiccups_beside_it():
    table = pd.DataFrame({"num_decode_seqs": [4, 5, 6], "duration": [2e-3, 12e-3, 2.2e-3],
                          "model_s": [1.9e-3, 1.9e-3, 1.9e-3], "attention_s": 0.0, "hiccup_s": [0.0, 9.9e-3, 0.0]})
    g = by_batch(table)
    assert g.hiccups.tolist() == [1]
    assert g.residual_us.iloc[0] == pytest.approx(3500.0)
    assert g.calm_residual_us.iloc[0] == pytest.approx(200.0)


def test_totals_give_the_models_error_with_and_without_the_hiccup_steps():
    table = pd.DataFrame({"duration": [2e-3, 12e-3, 2e-3], "model_s": [1.9e-3, 1.9e-3, 1.9e-3],
                          "hiccup_s": [0.0, 9.9e-3, 0.0]})
    line = totals(table)
    assert "model -64.4%" in line and "host hiccups 1 steps, 10 ms" in line and "the other steps: model -5.0%" in line
