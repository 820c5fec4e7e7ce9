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
    (["--profile", "nope.csv"], r"cluster.kv_receive_profile='nope.csv': no such file"),
])
def test_bad_arguments_are_refused_naming_them(args, match, capsys):
    with pytest.raises(SystemExit):
        main(["--model", "tiny-qwen3", *args])
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_it_needs_one():
    with pytest.raises(SystemExit, match="runs on a GPU"):
        main(["--model", "tiny-qwen3", "--blocks", "1,2", "--iters", "1"])
