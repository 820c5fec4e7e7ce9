"""`python -m experiments.profile` refuses a device it cannot run on before it builds anything:
one line `error: device=... is invalid: ...` and exit code 2, as every config error of the
profiler (no torch error from the runner, no Hydra line around it)."""
from __future__ import annotations

import sys

import pytest
import torch

import experiments.profile


@pytest.fixture
def nothing_built(monkeypatch):
    def no_runner(*args):
        raise AssertionError("the runner was built for a bad device")
    monkeypatch.setattr(experiments.profile, "build_runner", no_runner)


def profile_error(args: list[str], tmp_path, monkeypatch, capsys) -> str:
    """`python -m experiments.profile args` in this process: its one-line error (exit code 2)."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["profile", "model=tiny-llama", "calibrate=false", "progress=false",
                                      f"out={tmp_path / 'p.csv'}", f"operators_dir={tmp_path / 'ops'}",
                                      f"hydra.run.dir={tmp_path / 'run'}", *args])
    with pytest.raises(SystemExit) as exc:
        experiments.profile.main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Error executing job" not in err and "Traceback" not in err, err
    return err.strip()


DEVICES = "'cpu', 'cuda' or 'cuda:<index>'"
BAD_DEVICES = (  # (id, overrides, the error)
    ("tpu", ["device=tpu"], f"device='tpu' is invalid: {DEVICES}"),
    ("cuda-no-index", ["device=cuda:x"], f"device='cuda:x' is invalid: {DEVICES}"),
    ("cpu-with-index", ["device=cpu:0"], f"device='cpu:0' is invalid: {DEVICES}"),
    ("operators-tpu", ["mode=operators", "device=tpu"], f"device='tpu' is invalid: {DEVICES}"),
)


@pytest.mark.parametrize(("args", "says"), [r[1:] for r in BAD_DEVICES], ids=[r[0] for r in BAD_DEVICES])
def test_a_bad_device_is_one_line_before_the_runner(args, says, tmp_path, monkeypatch, capsys, nothing_built):
    assert profile_error(args, tmp_path, monkeypatch, capsys).startswith(f"error: {says}")


def test_cuda_without_cuda_is_one_line(tmp_path, monkeypatch, capsys, nothing_built):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = profile_error(["device=cuda"], tmp_path, monkeypatch, capsys)
    assert err == "error: device='cuda' is invalid: CUDA is not available here"


def test_a_gpu_index_past_the_machine_is_one_line(tmp_path, monkeypatch, capsys, nothing_built):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = profile_error(["device=cuda:2"], tmp_path, monkeypatch, capsys)
    assert err == "error: device='cuda:2' is invalid: this machine has 2 CUDA device(s), cuda:0 to cuda:1"


@pytest.mark.parametrize("args", [["warmup=-1"], ["mode=nope"]], ids=["warmup", "mode"])
def test_every_config_error_is_one_line_without_hydras_line(args, tmp_path, monkeypatch, capsys, nothing_built):
    err = profile_error(args, tmp_path, monkeypatch, capsys)
    assert err.startswith(f"error: {args[0].split('=')[0]}=")
