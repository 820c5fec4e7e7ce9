"""Trace text that the csv and json modules cannot read as it is: CSV prompts of token ids longer
than csv's default field limit are read; a CSV field longer than any prompt's ids can be, or text
csv cannot parse, is one ValueError naming the file and line (not a bare csv.Error)."""
from __future__ import annotations

import csv
import re

import numpy as np
import pytest
from test_workload_bad_input import raises
from workload_helpers import VOCAB, trace_workload

HEADERS = {
    "replay": "arrival_time,prompt_len,output_len",
    "azure": "TIMESTAMP,ContextTokens,GeneratedTokens",
    "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
}
ROWS = {"replay": "0,4,2", "azure": "2023-11-16 18:15:46,4,10", "burstgpt": "5,ChatGPT,4,3,0,x"}


def test_a_prompt_longer_than_csvs_default_field_limit_is_read(tmp_path):
    """40,000 ids (a prompt a 40,960-position model takes) of 3 digits and a space: 160k characters,
    past csv's default 131,072. The limit is process-wide: it is back at the default afterwards."""
    default = csv.field_size_limit()
    ids = np.random.default_rng(0).integers(100, VOCAB, size=40_000).tolist()
    field = " ".join(map(str, ids))
    assert len(field) > default
    w = trace_workload(tmp_path, "t.csv", f"arrival_time,prompt_token_ids,output_len\n0,{field},2\n0,1 2,3\n")
    assert [r.prompt_token_ids for r in w.requests] == [ids, [1, 2]]
    assert csv.field_size_limit() == default


@pytest.mark.parametrize("kind", list(HEADERS))
def test_a_field_longer_than_the_longest_prompts_ids_names_file_and_line(kind, tmp_path, monkeypatch):
    from experiments.lib.workloads import replay
    monkeypatch.setattr(replay, "MAX_LENGTH", 10)  # fields of at most 120 characters
    default = csv.field_size_limit()
    text = f"{HEADERS[kind]}\n{ROWS[kind]}\n\n{'7' * 121},{ROWS[kind]}\n"
    with raises(rf"^{re.escape(str(tmp_path / 't.csv'))}:4: a field of more than 120 characters, longer than the "
                r"10 token ids of the longest prompt can be$"):
        trace_workload(tmp_path, "t.csv", text, kind=kind)
    assert csv.field_size_limit() == default


@pytest.mark.parametrize("kind", list(HEADERS))
def test_text_csv_cannot_parse_names_file_and_line(kind, tmp_path):
    """A lone carriage return inside a line (a file of old Mac line ends, or a stray byte)."""
    text = f"{HEADERS[kind]}\n{ROWS[kind]}\n{ROWS[kind]}\r{ROWS[kind]}\n"
    with raises(rf"^{re.escape(str(tmp_path / 't.csv'))}:3: not valid CSV \(new-line character seen in unquoted "
                r"field"):
        trace_workload(tmp_path, "t.csv", text, kind=kind)


# ---- a byte order mark, an empty column name ------------------------------------------------------
BOM = "\ufeff"


@pytest.mark.parametrize(("kind", "name", "text"), [
    ("replay", "t.csv", "arrival_time,prompt_len,output_len\n0,4,2\n"),
    ("replay", "t.jsonl", '{"arrival_time": 0, "prompt_len": 4, "output_len": 2}\n'),
    ("azure", "t.csv", f"{HEADERS['azure']}\n{ROWS['azure']}\n"),
    ("burstgpt", "t.csv", f"{HEADERS['burstgpt']}\n{ROWS['burstgpt']}\n"),
    ("mooncake", "t.jsonl", '{"timestamp": 0, "input_length": 4, "output_length": 2, "hash_ids": [1]}\n'),
])
def test_a_trace_that_opens_with_a_byte_order_mark_is_read_as_without(kind, name, text, tmp_path):
    with_bom = trace_workload(tmp_path, name, BOM + text, kind=kind)
    assert with_bom.rows() == trace_workload(tmp_path, name, text, kind=kind).rows()


def test_an_empty_column_name_is_said_to_be_one(tmp_path):
    with raises(r"t\.csv:1: field '' is unknown \(an empty column name: a trailing comma in the header\?\): allowed "
                r"are \['request_id'"):
        trace_workload(tmp_path, "t.csv", "arrival_time,prompt_len,output_len,\n0,4,2,\n")
    with raises(r"t\.jsonl:1: field '' is unknown \(an empty key\): allowed are"):
        trace_workload(tmp_path, "t.jsonl", '{"arrival_time": 0, "prompt_len": 4, "output_len": 2, "": 1}\n')
