"""Decode attention on ragged batches in the `operators` latency model (sim/latency/operators.py):
a batch that leaves the decode kernel's wave part idle is priced towards its longest context."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from experiments.lib import factory
from sim.latency import BatchShape
from sim.latency.operator_profile import OperatorProfile, find_operator_files
from sim.latency.operators import OperatorModel

OPERATORS = Path(__file__).resolve().parents[2] / "experiments" / "profiles" / "operators"


@pytest.fixture(scope="module")
def h200_8b():
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=qwen3-8b"])
    profile = OperatorProfile.load(find_operator_files(OPERATORS, "h200", "bfloat16"))
    return profile, factory.model_shape(cfg)


def decodes(n: int, mean: int, longest: int) -> BatchShape:
    return BatchShape(num_decode_seqs=n, num_context_tokens=n * mean, num_samples=n, max_context_tokens=longest)


def test_a_small_ragged_batch_follows_its_longest_context(h200_8b):
    profile, shape = h200_8b
    mean_only = OperatorModel(profile, shape, 16)
    wave = OperatorModel(profile, shape, 16, decode_wave_programs=528)
    assert wave.uses_longest_context and not mean_only.uses_longest_context
    small = decodes(4, 500, 3000)  # 32 of 528 programs: nearly the longest context's time
    assert mean_only.shape_time(small) < wave.shape_time(small) <= mean_only.shape_time(decodes(4, 3000, 3000))
    assert wave.decode_pricing.decode_context(small) == pytest.approx(500 + (1 - 32 / 528) * 2500)
    full = decodes(66, 500, 3000)  # 66 x 8 programs fill the wave: the mean context's time
    assert wave.shape_time(full) == mean_only.shape_time(full)
    equal = decodes(4, 500, 500)
    assert wave.shape_time(equal) == mean_only.shape_time(equal)


def test_the_wave_size_is_checked(h200_8b):
    profile, shape = h200_8b
    with pytest.raises(ValueError, match=r"latency.decode_wave_programs=-1 is invalid"):
        OperatorModel(profile, shape, 16, decode_wave_programs=-1)
    built = factory.build_latency(_config("latency=operators", "model=qwen3-8b", "hardware=h200"))
    assert built.decode_wave_programs == 528


def _config(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))
