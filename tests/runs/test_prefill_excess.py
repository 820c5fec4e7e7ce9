"""The prefill engine's steps against a profile (experiments/lab/prefill_excess.py): host gaps and
duration over price, by the share of the step a KV message was on the wire, on a hand-built trace."""
import pandas as pd
import pytest

from experiments.lab.prefill_excess import by_share, even_prompts, prefill_steps, summary


def trace() -> pd.DataFrame:
    """Replica 0: three prefill steps of 4 ms, 1 ms of host time after each; replica 1 decodes."""
    row = {"num_prefill_seqs": 2, "num_prefill_tokens": 1000, "duration": 4e-3}
    rows = [{**row, "replica": 0, "step": i, "time": i * 5e-3} for i in range(3)]
    rows.append({"replica": 1, "step": 0, "time": 0.0, "num_prefill_seqs": 0, "num_prefill_tokens": 0,
                 "duration": 2e-3})
    return pd.DataFrame(rows)


def test_gaps_periods_and_the_ratio_by_wire_share():
    d = prefill_steps(trace())
    assert len(d) == 3 and d["gap"].iloc[:2].tolist() == pytest.approx([1e-3, 1e-3])
    assert d["period"].iloc[:2].tolist() == pytest.approx([5e-3, 5e-3]) and pd.isna(d["period"].iloc[2])
    assert "3 prefill steps, 1000 tokens and 2.00 prompts a step; duration 4.00 ms, host gap after 1.00 ms" \
        in summary("x", d)
    # One message on the wire for the whole second step (its prefill ended at 4 ms, sent at 5 ms, done at 9 ms).
    requests = pd.DataFrame({"arrival_time": [0.0], "queueing_time": [0.0], "prefill_time": [4e-3],
                             "transfer_time": [5e-3], "link_time": [4e-3]})
    text = by_share(d, requests, lambda tokens, prompts: 2e-3)
    assert "duration / price 2.000 mean" in text
    lines = [line.split() for line in text.splitlines()[2:]]
    assert [(cells[0], cells[1]) for cells in lines] == [("0", "2"), ("1", "1")]


def test_even_prompts_split_the_tokens_and_count_each_prompts_pairs():
    shape = even_prompts(7, 2)
    assert shape.prefill_chunks == ((4, 0), (3, 0)) and shape.prefill_attention_pairs == 10 + 6
    assert shape.num_prefill_seqs == shape.num_samples == 2 and even_prompts(5, 0).num_prefill_seqs == 1
