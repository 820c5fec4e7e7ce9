"""Host hiccups: decode-only steps far above the decode steps around them, flagged and reported."""
import pandas as pd
import pytest

from experiments.lib.fidelity_report import report_markdown
from experiments.lib.host_hiccups import hiccup_excess, hiccups


def steps_table(durations, prefill=None):
    prefill = prefill or [0] * len(durations)
    return pd.DataFrame({"duration": durations, "num_prefill_tokens": prefill,
                         "num_decode_seqs": [8] * len(durations)})


def test_a_burst_of_slow_decode_steps_is_flagged_with_its_excess():
    durations = [2e-3] * 30
    durations[10:13] = [6e-3, 17e-3, 5e-3]
    h = hiccups(steps_table(durations))
    assert h.steps == 3
    assert h.excess_s == pytest.approx(4e-3 + 15e-3 + 3e-3)
    assert h.decode_s == pytest.approx(sum(durations))
    assert h.percent == pytest.approx(100 * 22e-3 / sum(durations))


def test_a_slow_drift_and_small_or_relative_bumps_are_not_hiccups():
    ramp = [2e-3 + i * 2e-5 for i in range(40)]  # decode steps growing with the context
    ramp[20] += 4e-4  # above the median but under 0.5 ms
    assert hiccups(steps_table(ramp)).steps == 0
    long_steps = [13e-3] * 30
    long_steps[15] += 1.5e-3  # over 0.5 ms but under 25% of a long step
    assert hiccups(steps_table(long_steps)).steps == 0


def test_steps_with_prefill_are_neither_flagged_nor_counted():
    durations = [2e-3] * 21 + [30e-3]
    prefill = [0] * 21 + [4096]
    h = hiccups(steps_table(durations, prefill))
    assert h.steps == 0 and h.decode_s == pytest.approx(21 * 2e-3)
    assert len(hiccup_excess(steps_table(durations, prefill))) == 21


def test_bad_thresholds_are_refused_by_name():
    with pytest.raises(ValueError, match="window=0"):
        hiccup_excess(steps_table([1e-3]), window=0)


def test_the_report_states_a_scenarios_hiccups():
    table = pd.DataFrame(columns=["scenario", "metric", "label", "engine", "sim", "rel_error", "target",
                                  "within_target", "engine_spread"])
    meta = {"device": "d", "date": "t", "command": "c", "profile": "p", "versions": "v", "targets": "Targets",
            "runs_dir": "r"}
    settings = {"offline": {"overrides": [], "engine_hiccup_steps": 17, "engine_hiccup_s": 0.07,
                            "engine_hiccup_pct": 2.3}}
    text = report_markdown(meta, table, [], [], settings, 0.25)
    assert "engine host hiccups: 17 decode steps, 70 ms above their neighbours' median (2.3% of decode time)" in text
