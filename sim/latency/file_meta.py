"""The header every profile file opens with (latency profiles, sim/latency/profile_io.py; operator
profiles, sim/latency/operator_file.py; receive profiles, sim/latency/kv_receive.py; front host
profiles, sim/fleet/front_host.py): leading
`# key: value` comment lines, then the CSV's header line and its rows. And how those files, and the
workloads' trace files, are read: as UTF-8 text, line by line (`text_lines`). And whether the
`device` a profile was measured on is a conf/hardware GPU type (`device_is`, `check_device`).
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

# A profile measured on the CPU (the smoke runs' and CI's, `latency.gpu=cpu`): it stands for no GPU,
# so it goes with any hardware.
CPU_DEVICE = "cpu"


def _letters_and_digits(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def device_is(hardware_name: str, device: str) -> bool:
    """Whether `device` (a GPU's name as torch reports it, "NVIDIA H200 NVL") is of the GPU type
    conf/hardware calls `hardware_name` ("h200", "h200-nvl"): that name, or its part before the
    first "-", within the device's name, case and punctuation aside. experiments/profile.py names
    a GPU's profiles by the same rule."""
    return _letters_and_digits(hardware_name.split("-")[0]) in _letters_and_digits(device)


def check_device(what: str, device: str | None, hardware_name: str | None) -> None:
    """A profile (`what` names it) measured on another GPU type than the run's hardware prices
    steps of a GPU the run does not simulate: ValueError naming both. A profile without a `device`
    line, one measured on the CPU (CPU_DEVICE), and a run whose hardware is not known pass."""
    if device is None or hardware_name is None or device == CPU_DEVICE or device_is(hardware_name, device):
        return
    raise ValueError(f"{what} was measured on device={device!r}, not hardware={hardware_name!r}: profile that "
                     "GPU, or pick the hardware the profile was measured on")


def text_lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 text file without their line ends, read one at a time (a long trace is
    not read whole), and without the byte order mark some editors put first (else the first column
    name or JSON line starts with it). A byte that is not UTF-8 raises a ValueError naming the file,
    the line and the byte's position in the file."""
    offset = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[e.start]:02x} at position "
                                 f"{offset + e.start}): save the file as UTF-8") from None
            offset += len(raw)
            if number == 1:
                text = text.removeprefix("\ufeff")
            yield text.rstrip("\r\n")


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
