"""Profile files that are not UTF-8 text: every profile reader names the file, the line and the
byte (sim/latency/file_meta.py: text_lines), rather than a bare codec error."""
from __future__ import annotations

import re

import pytest

from sim.fleet.front_host import FrontHostProfile
from sim.latency.file_meta import text_lines
from sim.latency.kv_receive import read_receive_profile
from sim.latency.operator_file import read_operator_file
from sim.latency.profile_io import read_profile

READERS = {"latency": read_profile, "operators": read_operator_file, "kv_receive": read_receive_profile,
           "front_host": FrontHostProfile.read}


@pytest.mark.parametrize("reader", list(READERS.values()), ids=list(READERS))
def test_a_profile_that_is_not_utf8_names_the_file_line_and_byte(reader, tmp_path):
    path = tmp_path / "profile.csv"
    path.write_bytes(b"# model: m\nkind,time_s\n\xff,1\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: not UTF-8 text (byte 0xff at position 23)")):
        reader(path)


def test_text_lines_drops_line_ends_and_reads_utf8(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes("a,b\r\nü,2\n\nlast".encode())
    assert list(text_lines(path)) == ["a,b", "ü,2", "", "last"]


def test_text_lines_drops_a_byte_order_mark_at_the_start_only(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes("\ufeff# model: m\n\ufeffa\n".encode())
    assert list(text_lines(path)) == ["# model: m", "\ufeffa"]
