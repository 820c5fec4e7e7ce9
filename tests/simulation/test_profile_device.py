"""A latency or operator profile prices the GPU it was measured on: a run whose hardware is another
GPU type is refused, naming the profile's device and the run's hardware (sim/latency/file_meta.py)."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from experiments.lib import factory
from sim.latency.file_meta import check_device, device_is

H200_PROFILE = "latency.path=experiments/profiles/h200-qwen3-0.6b-async.csv"


def config(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(("hardware", "device", "same"), [
    ("h200", "NVIDIA H200", True),
    ("h100", "NVIDIA H100 80GB HBM3", True),
    ("h200-nvl", "NVIDIA H200 NVL", True),
    ("rtx4090", "NVIDIA GeForce RTX 4090", True),
    ("h200", "synthetic (roofline model of h200)", True),
    ("a100", "NVIDIA H200", False),
    ("h100", "NVIDIA H200", False),
])
def test_a_device_is_a_hardware_type_by_its_name(hardware, device, same):
    assert device_is(hardware, device) is same


def test_a_profile_of_another_gpu_is_refused_and_the_cpu_or_no_device_passes():
    with pytest.raises(ValueError, match=r"measured on device='NVIDIA H200', not hardware='a100'"):
        check_device("profile 'p'", "NVIDIA H200", "a100")
    for device in ("cpu", None):
        check_device("profile 'p'", device, "a100")
    check_device("profile 'p'", "NVIDIA H200", None)


def test_a_run_refuses_a_latency_profile_measured_on_another_gpu():
    with pytest.raises(ValueError, match=r"h200-qwen3-0.6b-async.csv' was measured on device='NVIDIA H200', "
                                         r"not hardware='a100'"):
        factory.build_latency(config("hardware=a100", "latency=profiled", H200_PROFILE))
    assert factory.build_latency(config("hardware=h200", "latency=profiled", H200_PROFILE)).name == "profiled"


def test_a_run_refuses_operator_profiles_measured_on_another_gpu():
    ops = ("latency=operators", "model=qwen3-0.6b")
    with pytest.raises(ValueError, match=r"h200-bfloat16-tma.csv' \(latency.gpu='h200'\) was measured on "
                                         r"device='NVIDIA H200', not hardware='a100'"):
        factory.build_latency(config("hardware=a100", "latency.gpu=h200", *ops))
    assert factory.build_latency(config("hardware=h200", *ops)).name == "operators"
    # the CPU's operator files (smoke runs) go with any hardware
    cpu = factory.build_latency(config("hardware=a100", *ops, "latency.gpu=cpu", "latency.dtype=float32"))
    assert cpu.name == "operators"
