"""The step profiler refuses, before it builds a runner, any grid shape the engine cannot run under
the profile's limits (max_model_len, max_num_batched_tokens, max_num_seqs), naming the field, the
value, what is allowed and the override that would allow it."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import experiments.profile
from experiments.lib.profiling.grid import ProfileGrid
from experiments.lib.profiling.limits import EngineLimits, check_grid
from tests.runs.test_profile import tiny_profile

ROOT = Path(__file__).resolve().parents[2]
PROFILE = yaml.safe_load((ROOT / "conf" / "profile.yaml").read_text())
DEFAULT_GRID = yaml.safe_load((ROOT / "conf" / "profile_grid" / "default.yaml").read_text())


def limits(**kw) -> EngineLimits:
    """conf/profile.yaml's limits, its decode growth (warmup + host_repeats), with `kw` over them."""
    base = {k: PROFILE[k] for k in ("max_num_batched_tokens", "max_num_seqs", "max_model_len")}
    return EngineLimits(**(base | {"decode_growth": PROFILE["warmup"] + PROFILE["host_repeats"]} | kw))


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf" / "profile_grid").glob("*.yaml")))
def test_the_shipped_grids_pass_under_the_profile_limits(name):
    grid = ProfileGrid.from_dict(yaml.safe_load((ROOT / "conf" / "profile_grid" / f"{name}.yaml").read_text()))
    check_grid(grid, limits())


def test_a_prefill_row_over_max_model_len_is_refused_with_the_override_that_allows_it():
    """The H200 run that died in a device-side assert: 8192-token steps, a 7936-token prefill row
    timed as one sequence, max_model_len=4096."""
    grid = ProfileGrid.from_dict(DEFAULT_GRID | {"prefill_tokens": [0, 2, 128, 512, 1024, 1536, 1792, 4096, 7936]})
    with pytest.raises(ValueError, match=r"profile_grid.prefill_tokens holds 7936, invalid with max_model_len=4096"
                                         r".* one sequence .* set max_model_len=7936"):
        check_grid(grid, limits(max_num_batched_tokens=8192))
    check_grid(grid, limits(max_num_batched_tokens=8192, max_model_len=7936))
    check_grid(ProfileGrid.from_dict(DEFAULT_GRID | {"prefill_tokens": [0, 2, 1024, 1536, 4096]}),
               limits(max_num_batched_tokens=8192))  # a prefill of exactly max_model_len runs


@pytest.mark.parametrize("overrides, kw, match", [
    ({"decode_seqs": [0, 1, 300]}, {}, r"decode_seqs holds 300, invalid with max_num_seqs=256.* max_num_seqs=300"),
    ({"decode_seqs": [0, 1, 255]}, {"max_num_batched_tokens": 200, "max_num_seqs": 256},
     r"decode_seqs holds 255, invalid with max_num_batched_tokens=200.* max_num_batched_tokens=255"),
    ({}, {"max_num_batched_tokens": 2000},
     r"prefill_tokens holds 1792 and decode_seqs 255, .* max_num_batched_tokens=2047"),
    ({}, {"max_num_seqs": 255}, r"max_num_seqs - 1 = 254 .* set max_num_seqs=256"),
    ({"split_counts": [1, 2, 4, 300]}, {"max_num_seqs": 256},
     r"split_counts holds 300, invalid with max_num_seqs=256.* max_num_seqs=300"),
    ({"context_ratios": [1.25, 3.0]}, {},
     r"context_per_decode holds 1536, .* 4608 tokens \(context_ratios 3.0 times it\) plus the 17 tokens"
     r".* set max_model_len=4625"),
    ({"context_ratios": []}, {"max_model_len": 2500},
     r"context_per_decode holds 1536, .* row of 255 sequences .* holds 2683 tokens \(spread from 1/4 to 7/4 of it\) "
     r"plus the 17 tokens .* set max_model_len=2700"),
])
def test_each_limit_names_the_field_the_value_and_the_override(overrides, kw, match):
    grid = ProfileGrid.from_dict(DEFAULT_GRID | overrides)
    with pytest.raises(ValueError, match=match):
        check_grid(grid, limits(**kw))


def test_the_decode_growth_counts_for_decode_only_rows():
    """A decode-only row is also an engine's step period: its sequences grow warmup + host_repeats
    tokens while it is timed, and must still fit."""
    grid = ProfileGrid.from_dict({"prefill_tokens": [0, 2], "decode_seqs": [0, 1], "context_per_decode": [60],
                                  "swap_blocks": [1], "split_prefill_tokens": [2], "split_counts": [1]})
    check_grid(grid, EngineLimits(64, 4, 64, decode_growth=4))
    with pytest.raises(ValueError, match=r"60 tokens .* plus the 5 tokens .* set max_model_len=65"):
        check_grid(grid, EngineLimits(64, 4, 64, decode_growth=5))


def test_limits_must_be_positive_integers():
    with pytest.raises(ValueError, match=r"max_model_len=0 is invalid: must be an integer >= 1"):
        EngineLimits(2048, 256, 0)


def test_the_profiler_refuses_the_grid_before_it_builds_a_runner(tmp_path, monkeypatch):
    """On the CPU the 80-token prefill row ended in an IndexError (the rotary table holds 64
    positions), on a GPU in a device-side assert, both after timing every shape before it."""
    def no_runner(*args):
        raise AssertionError("the runner was built for a grid over the engine's limits")
    monkeypatch.setattr(experiments.profile, "build_runner", no_runner)
    with pytest.raises(ValueError, match=r"prefill_tokens holds 80, invalid with max_model_len=64"):
        tiny_profile(tmp_path / "p.csv", ["profile_grid.prefill_tokens=[0,8,80]", "max_num_batched_tokens=128"])
