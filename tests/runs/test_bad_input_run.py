"""Bad input to `experiments.run`, table-driven (the other entry points: test_bad_input.py): config
files and overrides (one line on stderr naming the file or the command line and the key, exit 2)
and replay traces (a malformed row names the file, line and field; a request that can never run is
aborted with its reason while the rest of the run goes on)."""
from __future__ import annotations

import json
import logging
import re
import sys

import pandas as pd
import pytest

from experiments import run as run_module
from experiments.lib.cli import one_line
from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.metrics import summary_table
from experiments.lib.run_workload import run

QUICK = ["progress=false", "plots=false"]


def cli_error(args: list[str], monkeypatch, capsys) -> str:
    """`python -m experiments.run args` in this process: its one-line error (exit code 2)."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["run", *args, *QUICK])
    with pytest.raises(SystemExit) as exc:
        run_module.main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("error: ") and "\n" not in err, err
    return err


def _conf_file(tmp_path, group: str, text: str) -> list[str]:
    """A config file of `group` in an extra config directory, and the overrides that pick it."""
    (tmp_path / "conf" / group).mkdir(parents=True)
    (tmp_path / "conf" / group / "mine.yaml").write_text(text)
    return [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"{group}=mine"]


POISSON = ("name: mine\nkind: synthetic\nnum_requests: 5\narrival: poisson\nrate: 2.0\n"
           "prompt_len: {dist: uniform, low: 4, high: 8}\noutput_len: {dist: uniform, low: 2, high: 4}\n")
CONFIG = (  # (file group and text, or None) + overrides -> words the error must hold
    ("typo-in-workload-file", ("workload", POISSON + "max_token: 100\n"), [],
     r"conf/workload/mine.yaml: key workload.max_token is unknown"),
    ("typo-nested-in-workload-file", ("workload", POISSON.replace("low: 4", "lo: 4")), [],
     r"conf/workload/mine.yaml: key workload.prompt_len.lo is unknown"),
    ("typo-in-blocks-file", ("blocks", "kind: paged\nblock_size: 16\nnum_gpu_blocks: 64\nwatermak: 0.1\n"), [],
     r"conf/blocks/mine.yaml: key blocks.watermak is unknown"),
    ("wrong-type-in-backend-file", ("backend", "name: sim\nfast_forward: sometimes\n"), [],
     r"conf/backend/mine.yaml: backend.fast_forward is invalid"),
    ("typo-added-on-the-command-line", None, ["+workload.max_token=100"],
     r"the command line \(\+workload.max_token=100\): key workload.max_token is unknown"),
    ("unknown-top-level-key", None, ["+sed=3"], r"key sed is unknown"),
    ("scheduler-key", None, ["+scheduler.max_num_seq=3"], r"key scheduler.max_num_seq is unknown"),
    ("not-a-number", None, ["workload.rate=fast"], r"workload.rate is invalid"),
    ("rate-inf", None, ["workload=poisson", "workload.rate=inf"], r"workload.rate=inf is invalid"),
    ("time_scale-inf", None, ["workload=replay", "workload.time_scale=inf"], r"workload.time_scale=inf is invalid"),
)


@pytest.mark.parametrize(("conf_file", "overrides", "match"), [r[1:] for r in CONFIG], ids=[r[0] for r in CONFIG])
def test_config(conf_file, overrides, match, monkeypatch, capsys, tmp_path):
    extra = _conf_file(tmp_path, *conf_file) if conf_file else []
    err = cli_error([*extra, *overrides, f"hydra.run.dir={tmp_path / 'out'}"], monkeypatch, capsys)
    assert re.search(match, err), err


def test_a_repeated_cause_is_printed_once():
    try:
        try:
            raise ValueError("prompt too long")
        except ValueError as e:
            raise ValueError("prompt too long") from e
    except ValueError as e:
        assert one_line(e) == "prompt too long"


# ---- replay traces ------------------------------------------------------------------------------
def _trace(tmp_path, rows: list[dict | str]) -> list[str]:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return ["workload=replay", f"workload.path={path}", "model=tiny-qwen3", "scheduler.max_model_len=128"]


def _row(rid, t=0.0, prompt_len=8, out=3):
    return {"request_id": rid, "arrival_time": t, "prompt_len": prompt_len, "output_len": out}


TRACES = (  # the bad row is line 2
    ("arrival-inf", '{"arrival_time": Infinity, "prompt_len": 4, "output_len": 2}', r":2: field arrival_time=inf"),
    ("arrival-nan", '{"arrival_time": NaN, "prompt_len": 4, "output_len": 2}', r":2: field arrival_time=nan"),
    ("arrival-negative", _row("b", -1.0), r":2: field arrival_time=-1.0"),
    ("output_len-zero", _row("b", out=0), r":2: field output_len=0"),
    ("prompt-out-of-vocabulary", {"arrival_time": 0, "prompt_token_ids": [1, 10**9], "output_len": 2},
     r":2: field prompt_token_ids="),
    ("duplicate-id", _row("a"), r":2: field request_id='a' is invalid: must be unique"),
    ("not-json", "{arrival_time: 0", r":2: not valid JSON"),
    ("not-an-object", "[1, 2]", r":2: must be a JSON object"),
)


@pytest.mark.parametrize(("bad", "match"), [r[1:] for r in TRACES], ids=[r[0] for r in TRACES])
def test_trace_row(bad, match, monkeypatch, capsys, tmp_path):
    err = cli_error([*_trace(tmp_path, [_row("a"), bad, _row("c")]), f"hydra.run.dir={tmp_path / 'out'}"],
                    monkeypatch, capsys)
    assert "trace.jsonl" in err and re.search(match, err), err


@pytest.mark.parametrize(("ids", "expected"), [((1, 0), ["1", "0"]), ((7, 0), ["7", "0"]),
                                               ((None, 5), ["0", "5"])])
def test_request_id_zero_is_an_id(ids, expected, tmp_path):
    rows = [_row(rid, t=0.1 * i) for i, rid in enumerate(ids)]
    for row in rows:
        if row["request_id"] is None:
            del row["request_id"]
    run(compose_cfg([*_trace(tmp_path, rows), *QUICK]), tmp_path / "out")
    assert pd.read_parquet(tmp_path / "out" / "requests.parquet")["request_id"].tolist() == expected


ENGINE = ["backend=engine", "blocks.num_gpu_blocks=64", "blocks.swap_space_gib=0.01"]


@pytest.mark.parametrize("backend", [[], ENGINE], ids=["sim", "engine"])
def test_a_prompt_over_max_model_len_is_aborted_and_the_run_goes_on(backend, tmp_path, capsys):
    rows = [_row("a"), _row("too-long", 0.01, prompt_len=200), _row("c", 0.02)]
    summary = run(compose_cfg([*_trace(tmp_path, rows), *backend, *QUICK]), tmp_path / "out")
    req = pd.read_parquet(tmp_path / "out" / "requests.parquet").set_index("request_id")
    assert req.loc["too-long", "finish_reason"] == "abort:too_long"
    assert req.loc["too-long", "first_scheduled_time"] is None or pd.isna(req.loc["too-long", "first_scheduled_time"])
    assert (req.loc[["a", "c"], "output_len"] == 3).all() and summary["completed"] == 2
    assert summary["abort_reasons"] == {"abort:too_long": 1}
    assert "1 abort:too_long" in summary_table(summary)


def test_swap_without_swap_space_reports_its_fallbacks(tmp_path, caplog):
    overrides = ["policy.preemption_mode=swap", "blocks.num_cpu_blocks=0", "blocks.num_gpu_blocks=600",
                 "workload.num_requests=300", "workload.rate=100", *QUICK]
    with caplog.at_level(logging.WARNING, logger="servelab.scheduler"):
        summary = run(compose_cfg(overrides), tmp_path)
    assert summary["num_preempted_swap"] == 0 and summary["num_swap_fallbacks"] >= 50
    warnings = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert warnings and all("preempted by swap" not in w for w in warnings)
    assert "could not take its blocks" in warnings[0] and "fell back to recompute" in warnings[0]
    assert f"({summary['num_swap_fallbacks']} swaps fell back to recompute)" in summary_table(summary)
