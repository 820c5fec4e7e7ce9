"""Tensor-parallel size 1 prices exactly as the simulator did before tensor parallelism existed.

The goldens are RooflineModel step, swap and decode-run times and the default run's KV pool sizes,
computed by the pricing code as it stood before tensor-parallel pricing was added (the
llama-3.1-70b row with that code and today's conf/model file). Any term added at N = 1 (an
all-reduce, a per-GPU byte count, an interconnect figure read from conf/hardware) changes a bit of
them, and with them the simulator's results of record (experiments/results/showcase.md).
"""
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module

from experiments.lib import factory
from sim.latency import BatchShape, Hardware, ModelShape, RooflineModel

ROOT = Path(__file__).resolve().parents[2]
# (prefill tokens, prefill seqs, prefill context, prefill pairs, decode seqs, context tokens, samples, copies,
# prefill chunks): one short decode, two decode batches, one prefill, a mixed chunked step.
SHAPES = [
    BatchShape(0, 0, 0, 0, 1, 100, 1, 0, ()),
    BatchShape(0, 0, 0, 0, 64, 20000, 64, 0, ()),
    BatchShape(0, 0, 0, 0, 256, 600000, 256, 3, ()),
    BatchShape(512, 1, 0, 512 * 513 // 2, 0, 0, 1, 0, ((512, 0),)),
    BatchShape(2048, 2, 1000, 1500 * 1000 + 1500 * 1501 // 2 + 548 * 549 // 2, 30, 1030 + 9000, 32, 1,
               ((1500, 1000), (548, 0))),
]
# (model, hardware, block size): (shape times, swap_time(7), decode_times(32, 5000, 32, 3))
GOLDEN = {
    ("qwen3-0.6b", "h200", 16): (
        [0.0008502199069767443, 0.0015378311441860467, 0.021156870592966233, 0.0015886279894734684,
         0.006572088769388251], 0.00026054647272727275,
        [0.0010254691720930232, 0.0010265360372093022, 0.0010276029023255813]),
    ("llama-3.2-1b", "a100", 64): (
        [0.002219864888888889, 0.0027529820444444444, 0.018103737224208254, 0.006987056102091174,
         0.02949548742074108], 0.00061420256,
        [0.0023708707555555554, 0.0023715989333333333, 0.002372327111111111]),
    ("llama-3.1-70b", "h200", 16): (
        [0.04092721518139535, 0.04343491973953488, 0.12449873717309022, 0.13310202385624695,
         0.5546293027349187], 0.0006942756363636364,
        [0.04169516755348838, 0.04169821573953489, 0.0417012639255814]),
}
# overrides of the default run (model=qwen3-0.6b hardware=h200): (num_gpu_blocks, num_cpu_blocks)
KV_GOLDEN = {
    (): (1755, 2340),
    ("blocks.kv_cache_gib=4",): (2340, 2340),
    ("blocks.kv_cache_gib=1", "blocks.block_size=64"): (146, 585),
    ("blocks.kv_cache_gib=null",): (73181, 2340),
    ("model=llama-3.2-1b", "hardware=a100", "blocks.kv_cache_gib=null"): (142299, 8192),
}


def _load(kind: str, name: str) -> dict:
    return yaml.safe_load((ROOT / "conf" / kind / f"{name}.yaml").read_text())


@pytest.mark.parametrize("size_kw", [{}, {"tensor_parallel_size": 1}])
@pytest.mark.parametrize("key", list(GOLDEN))
def test_roofline_at_one_gpu_is_bit_identical_to_before_tensor_parallelism(key, size_kw):
    model, hardware, block_size = key
    r = RooflineModel(ModelShape.from_dict(_load("model", model)), Hardware.from_dict(_load("hardware", hardware)),
                      block_size, **size_kw)
    times, swap, decode = GOLDEN[key]
    assert [r.shape_time(s) for s in SHAPES] == times  # exact: no tolerance
    assert r.swap_time(7) == swap
    assert r.decode_times(32, 5000, 32, 3) == decode


def _cfg(overrides):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=["model=qwen3-0.6b", "hardware=h200", *overrides])


@pytest.mark.parametrize("overrides", list(KV_GOLDEN))
def test_default_runs_kv_pool_at_one_gpu_is_unchanged(overrides):
    assert factory.kv_block_counts(_cfg(overrides)) == KV_GOLDEN[overrides]
    assert factory.kv_block_counts(_cfg([*overrides, "parallel.tensor_parallel_size=1"])) == KV_GOLDEN[overrides]


def test_run_config_builds_the_one_gpu_roofline():
    r = factory.build_latency(_cfg(["latency=roofline"]))
    times, swap, decode = GOLDEN[("qwen3-0.6b", "h200", 16)]
    assert [r.shape_time(s) for s in SHAPES] == times
    assert r.swap_time(7) == swap and r.decode_times(32, 5000, 32, 3) == decode
