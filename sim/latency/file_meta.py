"""The header every profile file opens with (latency profiles, sim/latency/profile_io.py; operator
profiles, sim/latency/operator_file.py; receive profiles, sim/latency/kv_receive.py; front host
profiles, sim/fleet/front_host.py): leading
`# key: value` comment lines, then the CSV's header line and its rows."""
from __future__ import annotations

from collections.abc import Sequence


def read_meta(lines: Sequence[str]) -> tuple[dict[str, str], int]:
    """The leading comment lines' `key: value` pairs (a comment without a colon, and a blank line,
    are skipped) and the index of the first other line: the CSV header (len(lines): none)."""
    meta: dict[str, str] = {}
    for i, line in enumerate(lines):
        if line.startswith("#"):
            key, sep, value = line[1:].partition(":")
            if sep:
                meta[key.strip()] = value.strip()
        elif line.strip():
            return meta, i
    return meta, len(lines)
