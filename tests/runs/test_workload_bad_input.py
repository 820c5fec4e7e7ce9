"""Bad workload input: each is one ValueError naming the setting or the trace file and line, the
value and what is allowed, raised before anything large is built (the CLI prints it as one line,
tests/runs/test_bad_input_run.py)."""
from __future__ import annotations

import re

import pytest

from experiments.lib.workloads import build_workload

VOCAB = 1000


def trace(tmp_path, name: str, data: str | bytes, **cfg):
    """A `kind` (default replay) workload of the trace file `name` holding `data`."""
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return build_workload({"kind": "replay", "path": str(path), **cfg}, seed=0, vocab_size=VOCAB)


def raises(match: str):
    return pytest.raises(ValueError, match=match)


# ---- text that is not UTF-8 ---------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "name", "data"), [
    ("replay", "t.jsonl", b'{"arrival_time": 0, "prompt_len": 4, "output_len": 2}\n{"a\xff": 1}\n'),
    ("replay", "t.csv", b"arrival_time,prompt_len,output_len\n0,4,2\n0,\xff,2\n"),
    ("azure", "t.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff\n"),
    ("burstgpt", "t.csv", b"\xffTimestamp\n"),
    ("mooncake", "t.jsonl", b'{"timestamp": 0}\xfe\n'),
])
def test_a_trace_that_is_not_utf8_names_the_file_line_and_byte(kind, name, data, tmp_path):
    line = data[:data.index(b"\xff") if b"\xff" in data else data.index(b"\xfe")].count(b"\n") + 1
    with raises(rf"{re.escape(str(tmp_path / name))}:{line}: not UTF-8 text \(byte 0x(ff|fe) at position \d+\)"):
        trace(tmp_path, name, data, kind=kind)
