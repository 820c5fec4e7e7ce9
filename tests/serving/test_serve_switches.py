"""The server's boolean `EngineArgs` options are switches taking no value, as vLLM's
(`--disable-custom-all-reduce`, `--enforce-eager`, `--no-async-scheduling`); the parser alone, no
server started."""
from __future__ import annotations

import pytest
from optional_deps import require_serving

require_serving()  # engine.serve imports the serving stack

from engine import serve
from engine.engine_args import EngineArgs

SWITCHES = ("detokenize", "enable_chunked_prefill", "async_scheduling", "join_ahead", "enforce_eager",
            "disable_custom_all_reduce")


def _args(*argv: str) -> EngineArgs:
    return serve.engine_args_from(serve.parse_args(["--model", "tiny-qwen3", *argv]))


def test_the_boolean_fields_are_the_switches():
    assert serve.BOOLEAN_FIELDS == SWITCHES


@pytest.mark.parametrize("name", SWITCHES)
def test_a_switch_sets_its_field_its_no_form_clears_it_and_absent_keeps_the_default(name):
    option = "--" + name.replace("_", "-")
    assert getattr(_args(option), name) is True
    assert getattr(_args("--no-" + option[2:]), name) is False
    assert getattr(_args(), name) is getattr(EngineArgs(), name)
    assert getattr(_args(f"{name}=true"), name) is True  # the key=value override, unchanged


def test_disable_custom_all_reduce_takes_no_value():
    """A word after the switch is not its value: an override or the next option stays itself."""
    args = _args("--disable-custom-all-reduce", "num_gpu_blocks=64")
    assert args.disable_custom_all_reduce is True and args.num_gpu_blocks == 64
    args = _args("--disable-custom-all-reduce", "--num-gpu-blocks", "32")
    assert args.disable_custom_all_reduce is True and args.num_gpu_blocks == 32
    assert _args().disable_custom_all_reduce is False


@pytest.mark.parametrize("value", ["true", "false"])
def test_a_value_after_a_switch_is_one_line_naming_the_switches(value, capsys, monkeypatch):
    def no_engine(*args):
        raise AssertionError("the server went on to build its engine")
    monkeypatch.setattr(serve, "build_engine", no_engine)
    with pytest.raises(SystemExit) as info:
        serve.main(["--model", "tiny-qwen3", "--disable-custom-all-reduce", value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"override {value!r} is invalid" in err and "--disable-custom-all-reduce" in err
    assert "switches taking no value (--no-<option> for false)" in err
