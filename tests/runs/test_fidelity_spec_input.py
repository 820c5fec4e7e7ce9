"""A malformed fidelity spec (`experiments.fidelity --spec FILE`): one line naming the file (and
the line, for a YAML syntax error), exit code 2, no traceback."""
from __future__ import annotations

import re
import sys

import pytest

from experiments import fidelity
from experiments.lib.fidelity_spec import load_spec

SPECS = [  # file text -> the words the error must hold (FILE: the spec's path)
    ("scenarios: [\n", r"spec FILE:2: not valid YAML: expected the node content, but found '<stream end>'"),
    ("common: [a\nsim: [b]\n", r"spec FILE:2: not valid YAML: expected ',' or '\]', but got ':' "
                               r"\(while parsing a flow sequence from line 1\)"),
    ("common: [a]\n\tsim: [b]\n", r"spec FILE:2: not valid YAML: found character '\\t' that cannot start any token"),
    ("common: [a]\ncommon: [b]\n", r"spec FILE:2: not valid YAML: found duplicate key common"),
    ("- a\n- b\n", r"spec FILE is invalid: its top level is a list, not a mapping of keys \(common, engine, sim"),
]


@pytest.mark.parametrize("text, match", SPECS)
def test_a_malformed_spec_names_its_file(text, match, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match.replace("FILE", re.escape(str(path)))):
        load_spec(path)


def test_the_cli_gives_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    base = tmp_path / "base.yaml"
    base.write_text("scenarios: [\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text("extends: base.yaml\n")  # the error is the extended file's
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["fidelity", "--spec", str(spec), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exc:
        fidelity.main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith(f"error: spec {base}:2: not valid YAML") and "\n" not in err, err


def test_a_spec_that_is_not_utf8_names_the_file_line_and_byte(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_bytes(b"common: []\nsim: [\xff]\n")
    with pytest.raises(ValueError, match=re.escape(f"spec {path}:2: not UTF-8 text (byte 0xff at position 17): "
                                                   "save the file as UTF-8")):
        load_spec(path)
