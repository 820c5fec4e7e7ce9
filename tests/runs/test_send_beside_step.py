"""experiments.lab.send_beside_step's command line: bad input refused before any run."""
from __future__ import annotations

import re

import pytest
import torch

from experiments.lab.send_beside_step import main


@pytest.mark.parametrize(("args", "match"), [
    (["--blocks", "0,20"], r"--blocks='0,20' is invalid"),
    (["--delays", "0.5,1.5"], r"--delays='0.5,1.5' is invalid"),
    (["--prefill-tokens", "100", "--prefill-seqs", "200"], "--prefill-seqs=200 are invalid"),
    (["--profile", "nope.csv"], r"--profile='nope.csv': .*no such file"),
    (["--delays", "nan"], r"--delays='nan' is invalid"),
])
def test_bad_arguments_are_refused_naming_them(args, match, capsys):
    with pytest.raises(SystemExit):
        main(["--model", "tiny-qwen3", *args])
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_it_needs_one():
    with pytest.raises(SystemExit, match="runs on a GPU"):
        main(["--model", "tiny-qwen3", "--blocks", "1,2", "--iters", "1"])


def test_a_profile_of_another_model_is_refused(tmp_path, capsys):
    from sim.latency.kv_receive import write_receive_profile

    path = tmp_path / "qwen.csv"
    write_receive_profile(path, {"model": "qwen3-0.6b", "busy_share_curve": "1:1"}, [
        {"blocks": 1, "bytes": 1, "scatter_s": 0, "send_host_s": 0},
        {"blocks": 2, "bytes": 2, "scatter_s": 0, "send_host_s": 0}])
    with pytest.raises(SystemExit):
        main(["--model", "llama-3.2-1b", "--profile", str(path)])
    assert "is qwen3-0.6b's receive profile, not --model=llama-3.2-1b's" in capsys.readouterr().err
