"""experiments/lib/answer_hop.py: the hop between a pair's two loops, from the hand-offs reserved while
the front waited for a prefill step (the others wait out its host work, priced apart)."""
import pandas as pd
import pytest

from experiments.lib.answer_hop import answer_hop_s, answer_hops


def _trace(tmp_path, reserved: list[float], link_wait: list[float]):
    """Prefill steps on replica 0 at 0, 10 and 20 ms, each 8 ms long (host work 8-10, 18-20 ms); one
    handed-off request per reservation time; a decode step and a request served whole beside them."""
    steps = pd.DataFrame({"replica": [0, 0, 0, 1], "time": [0.0, 0.010, 0.020, 0.003],
                          "duration": [0.008, 0.008, 0.008, 0.004]})
    rows = []
    for i, (res, wait) in enumerate(zip(reserved, link_wait)):
        prefill_end = res - 0.001  # decode_wait 1 ms
        rows.append({"request_id": str(i), "arrival_time": 0.0, "queueing_time": 0.0, "prefill_time": prefill_end,
                     "decode_wait": 0.001, "link_wait": wait, "link_time": 0.002,
                     "transfer_time": 0.001 + wait + 0.002})
    rows.append({"request_id": "whole", "arrival_time": 0.0, "queueing_time": 0.0, "prefill_time": None,
                 "decode_wait": None, "link_wait": None, "link_time": None, "transfer_time": None})
    requests = pd.DataFrame(rows)
    requests.to_parquet(tmp_path / "requests.parquet")
    steps.to_parquet(tmp_path / "steps.parquet")
    return requests, steps


def test_only_answers_reserved_during_a_prefill_step_count(tmp_path):
    # reserved at 2 ms (in step 0), 9 ms (host work), 12 ms (in step 1), 25 ms (in step 2), 29 ms (after)
    requests, steps = _trace(tmp_path, [0.002, 0.009, 0.012, 0.025, 0.029], [0.001, 0.005, 0.002, 0.003, 0.007])
    assert sorted(answer_hops(requests, steps)) == pytest.approx([0.001, 0.002, 0.003])
    assert answer_hop_s(tmp_path) == (pytest.approx(0.002), 3)


def test_a_run_without_such_an_answer_is_named(tmp_path):
    _trace(tmp_path, [0.009, 0.019], [0.001, 0.001])
    with pytest.raises(ValueError, match="no hand-off was reserved while the front waited for a prefill step"):
        answer_hop_s(tmp_path)
