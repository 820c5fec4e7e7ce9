"""experiments.lab.link_by_size: a disaggregated run's KV messages read from its traces."""
from __future__ import annotations

import pandas as pd
import pytest

from experiments.lab.link_by_size import by_size, main, messages, wire_line


def _traces(bandwidth: float = 100e9, fixed: float = 0.001, step: float = 0.002):
    """Messages of 1-4 requests of 10 MB each, posted 0.1 s apart; each noticed `step / 2` after
    its wire ends (the decode steps are `step` long and end then)."""
    rows, steps = [], []
    for i in range(8):
        n = 1 + i % 4
        post, wire = 0.1 * i, fixed + n * 10e6 / bandwidth
        end = post + wire + step / 2
        steps.append({"replica": 1, "time": end - step, "duration": step})
        for j in range(n):
            rows.append({"request_id": f"{i}-{j}", "decode_replica": 1, "arrival_time": post - 0.01,
                         "queueing_time": 0.0, "prefill_time": 0.005, "decode_wait": 0.003,
                         "link_wait": 0.002, "link_time": end - post, "transfer_time": 0.005 + end - post,
                         "transfer_bytes": 10e6})
    steps.append({"replica": 0, "time": 0.0, "duration": 0.01})
    return pd.DataFrame(rows), pd.DataFrame(steps)


def test_messages_group_the_requests_posted_together_and_the_line_reads_the_wire():
    requests, steps = _traces()
    m = messages(requests, steps)
    assert len(m) == 8 and list(m["requests"]) == [1, 2, 3, 4] * 2
    assert m["mb"].tolist() == pytest.approx([10, 20, 30, 40] * 2)
    assert m["decode_step_s"].tolist() == pytest.approx([0.002] * 8)
    fixed, bandwidth = wire_line(m)
    assert fixed == pytest.approx(0.001) and bandwidth == pytest.approx(100e9)
    table = by_size(m, [15, 35])
    assert table["messages"].tolist() == [2, 4, 2]
    assert table["link_ms"].iloc[0] == pytest.approx((0.001 + 0.0001 + 0.001) * 1e3)
    assert wire_line(m.iloc[:2]) is None  # too few messages for a line


def test_the_command_reads_a_run_and_refuses_what_is_not_one(tmp_path, capsys):
    requests, steps = _traces()
    requests.to_parquet(tmp_path / "requests.parquet")
    steps.to_parquet(tmp_path / "steps.parquet")
    main([str(tmp_path), "--bins", "25"])
    out = capsys.readouterr().out
    assert "8 messages" in out and "wire 1.00 ms + bytes / 100 GB/s" in out
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--bins", "20,10"])
    assert "--bins='20,10' is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nope")])
    assert "not found" in capsys.readouterr().err


def test_each_message_is_matched_with_its_own_decode_replicas_steps():
    requests, steps = _traces()
    other = requests.assign(decode_replica=2, request_id=requests["request_id"] + "b")
    both = pd.concat([requests, other], ignore_index=True)
    m = messages(both, steps)  # replica 2 has no step rows: its messages have no decode step
    assert len(m) == 16 and sorted(set(m["decode_replica"])) == [1, 2]
    assert m.loc[m["decode_replica"] == 1, "decode_step_s"].tolist() == pytest.approx([0.002] * 8)
    assert m.loc[m["decode_replica"] == 2, "decode_step_s"].isna().all()
    assert wire_line(m) == pytest.approx(wire_line(m[m["decode_replica"] == 1]))  # NaN rows left out
    assert messages(requests.assign(link_time=float("nan")), steps).empty


def test_nan_bins_and_a_run_without_messages(tmp_path, capsys):
    requests, steps = _traces()
    requests.assign(link_time=float("nan")).to_parquet(tmp_path / "requests.parquet")
    steps.to_parquet(tmp_path / "steps.parquet")
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--bins", "nan"])
    assert "--bins='nan' is invalid" in capsys.readouterr().err
    main([str(tmp_path)])
    assert "no KV messages" in capsys.readouterr().out
