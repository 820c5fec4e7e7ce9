"""The simulator's results of record reproduce exactly: `python -m experiments.showcase --sections
1,2,3` writes experiments/results/showcase.md byte for byte. A change to the defaults those runs
read (scheduling mode, tensor-parallel size, hardware figures) or to the roofline's prices must pin
the record's settings in experiments/showcase.py or come with a new record."""
from pathlib import Path

import pytest

from experiments.showcase import _main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_showcase_sections_1_to_3_reproduce_the_record(tmp_path, capsys):
    text = _main(["--out", str(tmp_path), "--no-plots", "--sections", "1,2,3"])
    capsys.readouterr()
    record = (ROOT / "experiments/results/showcase.md").read_text()
    assert text.splitlines() == record.splitlines()
    assert text == record
