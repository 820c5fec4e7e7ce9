"""The decode-excess split: a hand-built decode engine trace whose every part of the excess is known."""
import pandas as pd
import pytest

from experiments.lab.decode_excess import by_share, decode_steps, link_busy, main, split_excess, wire_shares

AHEAD_S, SYNC_S = 2e-3, 3e-3  # the stand-in profile: every shape costs this


def price(n: int, c: int, sync: bool) -> float:
    return SYNC_S if sync else AHEAD_S


def trace(periods: list[float], ahead: list[bool], gaps: list[float]) -> pd.DataFrame:
    """Steps back to back: a step scheduled ahead starts at the last one's update; one that is not,
    `gap` later. `duration` is schedule to update (an ahead step's runs from the last update)."""
    row = {"replica": 1, "num_prefill_tokens": 0, "num_decode_seqs": 8, "num_running": 8, "num_finished": 0,
           "kv_tokens": 800, "num_swap_out_blocks": 0, "num_swap_in_blocks": 0}
    rows, t = [{**row, "step": 0, "time": 0.0, "duration": AHEAD_S}], AHEAD_S  # the first one's predecessor
    for p, a, g in zip(periods, ahead, gaps):
        t += 0.0 if a else g
        rows.append({**row, "step": len(rows), "time": t, "duration": p})
        t += p
    rows.append({**row, "step": len(rows), "time": t, "duration": AHEAD_S})  # the last one's successor
    return pd.DataFrame(rows)


def test_each_part_of_the_excess_lands_in_its_class():
    # step 0: ahead at its price; 1: ahead, 0.2 ms over; 2: ahead before a sync step; 3: sync, 0.4 ms
    # over its sync price after a 0.5 ms host gap; 4: ahead with a receive on the wire, 0.3 ms over.
    periods = [AHEAD_S, AHEAD_S + 2e-4, AHEAD_S + 1e-4, SYNC_S + 4e-4, AHEAD_S + 3e-4]
    ahead = [True, True, True, False, True]
    gaps = [0, 0, 0, 5e-4, 0]
    d = decode_steps(trace(periods, ahead, gaps))
    assert d["ahead"].tolist() == ahead
    assert d["period"].iloc[2] == pytest.approx(AHEAD_S + 1e-4 + 5e-4)  # its period holds the host gap
    t4 = d["time"].iloc[4]
    requests = pd.DataFrame({"arrival_time": [t4 - 1e-3], "queueing_time": [0.0], "prefill_time": [5e-4],
                             "transfer_time": [1e-3], "link_time": [4e-4]})  # on the wire t4 + 0.1 to 0.5 ms
    busy = link_busy(d, requests)
    assert busy.tolist() == [False, False, False, False, True]
    s = split_excess(d, price, busy)
    assert s["sync"] == pytest.approx(4e-4)
    assert s["pipeline break"] == pytest.approx(SYNC_S - AHEAD_S)
    assert s["before sync: host gap"] == pytest.approx(5e-4)
    assert s["before sync: rest"] == pytest.approx(1e-4)
    assert s["ahead, link busy"] == pytest.approx(3e-4)
    assert s["ahead, link idle"] == pytest.approx(2e-4)
    parts = ("sync", "pipeline break", "before sync: host gap", "before sync: rest", "ahead, link busy",
             "ahead, link idle")
    assert sum(s[k] for k in parts) == pytest.approx(s["total"])
    assert s["n sync"] == 1 and s["n before sync"] == 1 and s["n ahead, link idle"] == 2


def test_steps_with_prefill_or_swaps_are_left_out():
    t = trace([AHEAD_S] * 4, [True] * 4, [0] * 4)
    t.loc[1, "num_prefill_tokens"] = 512
    t.loc[2, "num_swap_in_blocks"] = 3
    t.loc[3, "num_finished"] = 8  # the replica empty after it: idle time in its period
    assert decode_steps(t)["step"].tolist() == [4]
    assert not link_busy(decode_steps(t), None).any()


def test_the_command_names_a_missing_scenario(tmp_path, capsys):
    run = tmp_path / "pd_1" / "engine"
    run.mkdir(parents=True)
    trace([AHEAD_S] * 3, [True] * 3, [0] * 3).to_parquet(run / "steps.parquet")
    profile = "experiments/profiles/h200-qwen3-0.6b-async-8k.csv"
    main(["--runs", str(tmp_path), "--profile", profile])
    assert "pd_1 replica 1: 3 decode-only steps" in capsys.readouterr().out
    main(["--runs", str(tmp_path), "--profile", profile, "--by-share"])
    assert "share of their period the wire was busy:" in capsys.readouterr().out
    main(["--runs", str(tmp_path), "--profile", profile, "--by-share", "--busy-from", "posted"])
    assert "share of their period a receive was posted and not done:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="nope has no"):
        main(["--runs", str(tmp_path), "--profile", profile, "--scenarios", "nope"])


def test_a_receive_counts_from_its_posting_with_busy_from_posted():
    """Posted at its reservation (`decode_wait` after the prefill), on the wire later: the steps in
    between are busy only when counted from the posting."""
    d = decode_steps(trace([AHEAD_S] * 4, [True] * 4, [0] * 4))
    t1, t3 = d["time"].iloc[1], d["time"].iloc[3]
    requests = pd.DataFrame({"arrival_time": [t1 - 1e-3], "queueing_time": [0.0], "prefill_time": [5e-4],
                             "decode_wait": [6e-4], "transfer_time": [t3 + 1e-4 - t1 + 5e-4],
                             "link_time": [2e-4]})  # posted at t1 + 0.1 ms, sent at t3 - 0.1 ms
    assert link_busy(d, requests).tolist() == [False, False, True, True]
    assert link_busy(d, requests, posted=True).tolist() == [False, True, True, True]
    assert wire_shares(d, requests, posted=True).round(6).tolist() == [0.0, 0.95, 1.0, 0.05]
    assert wire_shares(d, requests).round(6).tolist() == [0.0, 0.0, 0.05, 0.05]
    posted = by_share(d, price, wire_shares(d, requests, posted=True)).splitlines()
    assert [row.split()[:3] for row in posted[1:]] == [["0", "1", "0.000"], ["0-0.25", "1", "0.050"],
                                                      ["0.75-1", "1", "0.950"], ["1", "1", "1.000"]]


def test_by_share_bins_the_ahead_steps_by_the_share_of_their_period_on_the_wire():
    """Step 1 covered for 40% by a receive's wire interval, step 2 whole, the others not at all."""
    d = decode_steps(trace([AHEAD_S, 1.5 * AHEAD_S, 2 * AHEAD_S, AHEAD_S], [True] * 4, [0] * 4))
    t1, t2 = d["time"].iloc[1], d["time"].iloc[2]
    requests = pd.DataFrame({"arrival_time": [t1 - 1e-3], "queueing_time": [0.0], "prefill_time": [5e-4],
                             "transfer_time": [t2 + 2 * AHEAD_S - t1 + 5e-4],
                             "link_time": [t2 + 2 * AHEAD_S - t1 - 0.9 * AHEAD_S]})  # from t1 + 1.8 ms
    assert wire_shares(d, requests).round(6).tolist() == [0.0, 0.4, 1.0, 0.0]
    table = by_share(d, price, wire_shares(d, requests)).splitlines()
    assert table[1].split() == ["0", "2", "0.000", "1.000", "1.000"]
    assert table[2].split() == ["0.25-0.5", "1", "0.400", "1.500", "1.500"]
    assert table[3].split() == ["1", "1", "1.000", "2.000", "2.000"]
