"""Metrics on a hand-made trace (vLLM's definitions), and byte-stable parquet."""
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from property_settings import examples

from experiments.lib.metrics import kv_metrics, summarize, summary_table
from experiments.lib.traces import load_run, requests_frame, steps_frame, write_traces
from policies.trace import STEP_COLUMNS


def req(rid, arrival, sched, first, times, finish, prompt, out, status="finished", prio=0):
    ttft = None if first is None else first - arrival
    e2e = finish - arrival
    tpot = (e2e - ttft) / (out - 1) if ttft is not None and out > 1 else None
    return {"request_id": rid, "arrival_time": arrival, "priority": prio, "prompt_len": prompt, "output_len": out,
            "n": 1, "first_scheduled_time": sched, "first_token_time": first, "finish_time": finish,
            "num_preemptions": 0, "num_swaps": 0, "status": status,
            "finish_reason": "length" if status == "finished" else "abort:too_long",
            "ttft": ttft, "tpot": tpot, "e2e": e2e, "queueing_time": None if sched is None else sched - arrival,
            "token_times": times}


def step(i, time, duration, used, kv_tokens):
    row = dict.fromkeys(STEP_COLUMNS, 0)
    row.update(step=i, time=time, duration=duration, gpu_blocks_used=used, gpu_blocks_total=10, kv_tokens=kv_tokens,
               num_decode_seqs=1, num_running=1)
    return row


@pytest.fixture
def recorder():
    return SimpleNamespace(
        requests=[req("a", 0.0, 0.5, 1.0, [1.0, 1.5, 2.5], 2.5, 10, 3),
                  req("b", 1.0, 1.0, 2.0, [2.0], 2.0, 4, 1, prio=1),
                  req("c", 2.0, None, None, [], 3.0, 7, 0, status="aborted")],
        steps=[step(0, 0.0, 1.0, 2, 6), step(1, 1.0, 3.0, 4, 8)], events=[], record_events=False)


def test_hand_computed_metrics(recorder):
    s = summarize(requests_frame(recorder), steps_frame(recorder), block_size=4,
                  slo={"ttft_s": 1.0, "tpot_s": 0.5, "e2el_s": None})
    assert (s["completed"], s["aborted"], s["abort_reasons"]) == (2, 1, {"abort:too_long": 1})
    assert s["duration_s"] == 3.0
    assert s["request_throughput"] == pytest.approx(2 / 3)
    assert s["output_throughput"] == pytest.approx(4 / 3)
    assert s["total_token_throughput"] == pytest.approx((14 + 4) / 3)
    assert s["ttft"]["mean"] == pytest.approx(1.0) and s["ttft"]["std"] == pytest.approx(0.0)
    assert s["tpot"]["mean"] == pytest.approx(0.75)  # (2.5 - 1.0) / (3 - 1); b has a single token
    assert s["itl"]["mean"] == pytest.approx(0.75) and s["itl"]["median"] == pytest.approx(0.75)
    assert s["itl"]["p99"] == pytest.approx(0.5 + 0.99 * 0.5)
    assert s["e2e"]["median"] == pytest.approx(1.75)
    assert s["queueing_time"]["mean"] == pytest.approx(0.25)
    assert s["goodput"] == pytest.approx(1 / 3)  # a misses the TPOT SLO
    assert s["kv_utilization"] == pytest.approx((6 / 8 * 1 + 8 / 16 * 3) / 4)
    assert s["kv_waste"] == pytest.approx(1 - s["kv_utilization"])
    assert s["gpu_blocks_used_peak"] == 4
    assert set(s["per_priority"]) == {"0", "1"}
    assert "TTFT mean / p50 / p99 (ms)      1000.0 / 1000.0 / 1000.0" in summary_table(s)


def test_kv_waste_is_never_negative_when_blocks_are_shared():
    """A prefix cache's shared blocks put kv_tokens above the allocated slots: utilisation passes
    100% and such a step wastes nothing (not a negative share)."""
    frame = pd.DataFrame([step(0, 0.0, 1.0, 2, 12), step(1, 1.0, 1.0, 4, 8)])  # 150% and 50%
    s = kv_metrics(frame, block_size=4)
    assert s["kv_utilization"] == pytest.approx(1.0)
    assert s["kv_waste"] == pytest.approx(0.25)  # (0 + 0.5) / 2


@hsettings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 40), st.floats(0.01, 5.0)), min_size=1, max_size=8))
def test_kv_waste_is_a_share_and_one_minus_utilisation_without_sharing(rows):
    """kv_waste lies in [0, 1]; where no step's sequences hold more tokens than its blocks have slots
    it is 1 - kv_utilization."""
    frame = pd.DataFrame([step(i, float(i), d, used, tokens) for i, (tokens, used, d) in enumerate(rows)])
    s = kv_metrics(frame, block_size=4)
    assert 0.0 <= s["kv_waste"] <= 1.0
    if all(tokens <= used * 4 for tokens, used, _ in rows):
        assert s["kv_waste"] == pytest.approx(1.0 - s["kv_utilization"])


def test_without_slo_goodput_counts_every_completed_request(recorder):
    s = summarize(requests_frame(recorder), steps_frame(recorder), block_size=4, slo=None)
    assert s["goodput"] == s["request_throughput"]


def test_parquet_is_byte_stable_and_round_trips(recorder, tmp_path):
    write_traces(recorder, tmp_path / "x")
    write_traces(recorder, tmp_path / "y")
    for name in ("requests.parquet", "steps.parquet"):
        assert (tmp_path / "x" / name).read_bytes() == (tmp_path / "y" / name).read_bytes()
    run = load_run(tmp_path / "x")
    assert list(run.requests["request_id"]) == ["a", "b", "c"]
    assert np.allclose(run.requests.loc[0, "token_times"], [1.0, 1.5, 2.5])
    assert np.isnan(run.requests.loc[2, "ttft"])
