"""experiments.lab.front_parts: a pair scenario's engine run (the tiny model over gloo on the CPU)
with its front timed by part, per prefill step, and the runs' traces left for prefill_excess."""
import json

import pandas as pd
import pytest
from test_fidelity_disagg import TINY  # the disagg spec at a size the CPU runs in seconds

from engine.disagg.pd_engine import DisaggregatedEngine
from experiments.lab.front_parts import main
from experiments.lib.front_timers import NOT_HOST
from sim.fleet.front_host import FrontHostProfile


def test_a_pair_runs_with_its_front_timed_by_part(request, tmp_path, capsys):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY.format(spec=request.config.rootpath / "conf/fidelity/disagg.yaml"))
    init = DisaggregatedEngine.__init__
    main(["--spec", str(spec), "--scenarios", "pd_400", "--runs", str(tmp_path / "runs"), "--detail", "KVLink.send",
          "--profile-out", str(tmp_path / "front.csv")])
    assert DisaggregatedEngine.__init__ is init  # the fronts built afterwards are plain
    s = json.loads((tmp_path / "runs" / "front_parts.json").read_text())["pd_400"]
    parts = s["parts"]
    assert s["prefill_steps"] >= 1 and parts["forward"]["calls"] == pytest.approx(1.0)
    assert parts["add_request"]["calls"] * s["prefill_steps"] == pytest.approx(8)  # every request admitted once
    assert parts["schedule"]["calls"] >= 1 and parts["KVLink.send"]["calls"] > 0
    host = [v["wall_ms"] for p, v in parts.items() if p not in NOT_HOST]
    assert s["host_ms_per_step"] == pytest.approx(sum(host)) and s["host_ms_per_step"] > 0
    assert 0 < s["run_wall_s"] and s["outside_front_ms_per_step"] >= 0
    out = capsys.readouterr().out
    assert "## pd_400" in out and "## pd_400: " in out  # the parts, then the answers' split
    answers = pd.read_csv(tmp_path / "runs" / "pd_400.answers.csv")
    assert len(answers) == pytest.approx(parts["KVLink.send"]["calls"] * s["prefill_steps"])  # a row per send
    # The reader sees an answer after its reservation, the front posts it after the reader saw it.
    assert (answers["to_post"] >= 0).all() and (answers["to_reader"] > 0).all()
    assert answers["link_wait"].to_numpy() == pytest.approx((answers["to_reader"] + answers["to_post"]).to_numpy())
    assert (tmp_path / "runs" / "pd_400" / "engine" / "steps.parquet").is_file()
    meta = json.loads((tmp_path / "runs" / "meta.json").read_text())
    assert meta["scenarios"] == {"pd_400": {}} and meta["device"] == "cpu"
    from experiments.fidelity import _main as fidelity  # the runs are a fidelity report's engine half
    fidelity(["--spec", str(spec), "--engine-runs", str(tmp_path / "runs"), "--runs", str(tmp_path / "sim"),
              "--scenarios", "pd_400"])
    assert "pd_400" in (tmp_path / "sim" / "report" / "fidelity.md").read_text()
    detail = (tmp_path / "runs" / "pd_400.detail.txt").read_text()
    assert detail.startswith(f"# KVLink.send: {round(parts['KVLink.send']['calls'] * s['prefill_steps'])} calls")
    assert "gather_blocks" in detail  # the send's own functions
    profile = FrontHostProfile.read(tmp_path / "front.csv")
    assert profile.model == "tiny-qwen3" and dict(profile.meta)["scenario"] == "pd_400"
    assert profile.kv_message_s > 0 and profile.admission_s > 0 and profile.step_s > 0
    # The same profile again from the runs' front_parts.json, running nothing.
    main(["--spec", str(spec), "--runs", str(tmp_path / "runs"), "--from-json", "--profile-out",
          str(tmp_path / "again.csv")])
    assert FrontHostProfile.read(tmp_path / "again.csv").as_dict() == pytest.approx(profile.as_dict())


def test_a_scenario_without_a_pair_is_refused(request, tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY.format(spec=request.config.rootpath / "conf/fidelity/disagg.yaml"))
    with pytest.raises(RuntimeError, match="each must be a pair scenario"):
        main(["--spec", str(spec), "--scenarios", "mixed_400", "--runs", str(tmp_path / "runs")])
    with pytest.raises(ValueError, match="--detail='send' is not a part of the front"):
        main(["--spec", str(spec), "--scenarios", "pd_400", "--runs", str(tmp_path / "r2"), "--detail", "send"])


def test_the_reads_are_priced_per_decode_step_message():
    """The decode process's messages with outputs (`decode outputs`, once each) carry the reads'
    time; the front's other reads (`Reserved` answers) are in `recv + unpickle`'s calls but not
    in the messages the simulator charges."""
    from experiments.lab.front_parts import HANDOFF_PARTS, STEP_PARTS, profile_from

    parts = {p: {"wall_ms": 0.0, "cpu_ms": 0.0, "calls": 1.0} for p in (*STEP_PARTS, *HANDOFF_PARTS)}
    parts |= {"add_request": {"wall_ms": 0.2, "calls": 2.0}, "KVLink.send": {"wall_ms": 0.7, "calls": 1.0},
              "start transfer (rest)": {"wall_ms": 0.0, "calls": 1.0},
              "pickle + queue message": {"wall_ms": 0.2, "calls": 2.0},
              "PrefillSide.hand_off": {"wall_ms": 0.1, "calls": 2.0},
              "recv + unpickle": {"wall_ms": 0.3, "calls": 3.0},  # two decode steps' messages and one answer
              "take messages (rest)": {"wall_ms": 0.06, "calls": 1.0},
              "decode outputs": {"wall_ms": 0.04, "calls": 2.0}}
    profile = profile_from({"parts": parts, "outside_front_ms_per_step": 0.0})
    assert profile.read_message_s == pytest.approx(0.4e-3 / 2)
    assert profile.admission_s == pytest.approx(0.1e-3) and profile.kv_message_s == pytest.approx(0.7e-3)
