"""experiments.disagg_sweep (docs/disaggregation.md): goodput per GPU of splits against mixed
replicas per TPOT SLO, the winner per TPOT and where it changes."""
from __future__ import annotations

import sys

import pandas as pd
import pytest

from experiments import disagg_sweep
from experiments.lib.search.pd_sweep import best_per_tpot, check_sweep, crossovers


def test_the_winner_and_crossover_per_tpot():
    sweep = pd.DataFrame({"tpot_ms": [2, 2, 2, 10, 10, 10], "pd_split": ["mixed", "1:1", "1:3"] * 2,
                          "capacity_per_gpu_rps": [1.0, 3.0, 2.0, 9.0, 4.0, 5.0]})
    best = best_per_tpot(sweep)
    assert list(best["winner"]) == ["split", "mixed"] and list(best["best_split"]) == ["1:1", "1:3"]
    assert crossovers(best) == [(2.0, 10.0, "mixed")]


@pytest.mark.parametrize("bad", [None, [], [0.01, -1], "0.01"])
def test_a_bad_sweep_names_the_key(bad):
    with pytest.raises(ValueError, match="sweep.tpot_s="):
        check_sweep(bad)


def test_a_tiny_sweep_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [
        "disagg_sweep", "sweep.tpot_s=[0.002,0.05]", "workload=poisson",
        "workload.prompt_len={dist: uniform, low: 16, high: 64}", "workload.output_len={dist: uniform, low: 4, high: 16}",
        "search.duration_s=1", "search.rate.max_iterations=3", "search.space.max_num_seqs=[8]",
        f"search.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'out'}"])
    disagg_sweep.main()
    out = capsys.readouterr().out
    sweep = pd.read_csv(tmp_path / "out" / "sweep.csv")
    assert sorted(set(sweep["pd_split"])) == ["1:1", "mixed"] and sorted(set(sweep["tpot_ms"])) == [2.0, 50.0]
    assert (sweep["num_gpus"] == 2).all() and "winner" in out
    assert (tmp_path / "out" / "best.csv").is_file() and (tmp_path / "out" / "tpot_2ms" / "table.csv").is_file()
