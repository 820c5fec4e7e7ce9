"""experiments.ab's command line: options may come between overrides, and a side written wrong
(an unbalanced bracket, a side other than a and b) is one line naming it, not Hydra's parser error."""
from __future__ import annotations

import re
import sys

import pytest

from experiments import ab
from experiments.ab import _main, split_overrides

SMALL = ["workload.num_requests=6", "progress=false", "plots=false"]


def test_overrides_after_an_option(tmp_path):
    result = _main(["a=[policy=fcfs]", "--out", str(tmp_path), "b=[policy=priority]", *SMALL, "--resamples", "50"])
    assert result.summary_a["completed"] == result.summary_b["completed"] == 6 and (tmp_path / "ab.csv").is_file()
    assert result.summary_b["run"]["policy"] == "priority"


@pytest.mark.parametrize("text", ["[policy=fcfs", "policy=fcfs]", "[x=[1,2]", "[x=1]]", "[x='a]"])
def test_unbalanced_sides_are_refused(text):
    with pytest.raises(ValueError, match=r"a=.* is invalid: unbalanced brackets or quotes \(e.g. a='\[policy=fcfs\]'\)"):
        split_overrides(text, "a")


@pytest.mark.parametrize("args, match", [
    (["a=[policy=fcfs]", "b=[policy=priority]", "c=[policy=sjf]"],
     r"error: c='\[policy=sjf\]' is invalid: only a='\[...\]' and b='\[...\]' hold a side's overrides"),
    (["a=[policy=fcfs", "b=[policy=priority]"], r"error: a='\[policy=fcfs' is invalid: unbalanced brackets"),
])
def test_the_cli_names_the_bad_side(args, match, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["ab", *args, *SMALL, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        ab.main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "\n" not in err, err
    assert re.match(match, err), err


def test_a_common_list_override_is_no_side():
    assert not ab._side_like("cluster.hardware=[h200,a100]") and not ab._side_like("workload.rates=[1,2]")
    assert ab._side_like("c=[policy=sjf]") and ab._side_like("side=[+blocks.x=1]")
