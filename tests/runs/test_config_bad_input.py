"""Bad values of the run config's own sections (scheduler, slo, parallel, blocks, latency) on the
simulator's path: one line naming the key, the value and what is allowed, exit code 2, the same
rule wherever another entry point (the engine, experiments.search) checks the same value."""
from __future__ import annotations

import re

import pytest
from test_bad_input_run import cli_error

SMALL = ["workload.num_requests=5"]


@pytest.mark.parametrize("overrides, match", [
    (["scheduler.max_model_len=100000000"],
     r"scheduler.max_model_len=100000000 is invalid: model=qwen3-0.6b supports at most max_position_embeddings=40960"),
    (["model=tiny-qwen3"], r"scheduler.max_model_len=4096 is invalid: model=tiny-qwen3 supports at most "
                           r"max_position_embeddings=2048"),
    (["slo.ttft_s=-1"], r"slo.ttft_s=-1 is invalid: must be a number > 0 \(seconds\) or null"),
    (["slo.tpot_s=0"], r"slo.tpot_s=0 is invalid: must be a number > 0 \(seconds\) or null"),
    (["slo.e2el_s=inf"], r"slo.e2el_s=inf is invalid: must be a number > 0 \(seconds\) or null"),
    (["blocks.gpu_memory_utilization=0"], r"blocks.gpu_memory_utilization=0 is invalid: must be in \(0, 1\]"),
    (["blocks.gpu_memory_utilization=1.5", "blocks.num_gpu_blocks=100"],
     r"blocks.gpu_memory_utilization=1.5 is invalid: must be in \(0, 1\]"),
    (["blocks.gpu_memory_utilization=null", "blocks.kv_cache_gib=null"],
     r"blocks.gpu_memory_utilization=None is invalid: must be in \(0, 1\] to size the KV pool from GPU memory"),
    (["parallel.all_reduce_kernel=nope"], r"parallel.all_reduce_kernel='nope' is invalid: one of \('auto', 'torch'"),
    (["parallel.custom_all_reduce_max_bytes=-1"], r"parallel.custom_all_reduce_max_bytes=-1 is invalid: a byte count"),
    (["parallel.custom_all_reduce_one_shot_max_bytes=17"],
     r"parallel.custom_all_reduce_one_shot_max_bytes=17 is invalid: a byte count in \[0, 1073741824\], a multiple of 16"),
    (["parallel.disable_custom_all_reduce=true", "backend=server", "backend.url=http://127.0.0.1:1",
      "parallel.all_reduce_kernel=nope"], r"parallel.all_reduce_kernel='nope' is invalid"),  # every backend
    (["parallel.tensor_parallel_size=0"], r"^error: parallel.tensor_parallel_size=0 is invalid: must be an integer >= 1"),
    (["cluster.replicas=2", "cluster.hardware=nope"],
     r"the command line \(cluster.hardware=nope\): cluster.hardware='nope' is invalid: must be a list \(\[a, b\]\), or null"),
    (["serving.ttft_jitter_s=3"], r"serving.ttft_jitter_s=3 is invalid: must be a list \(\[a, b\]\)$"),
    (["workload=poisson", "workload.rate=1", "workload.rate=fast"],  # the one that stands is named
     r"the command line \(workload.rate=fast\): workload.rate is invalid"),
])
def test_bad_value_is_one_line(overrides, match, monkeypatch, capsys):
    err = cli_error([*SMALL, *overrides], monkeypatch, capsys)
    assert re.search(match, err), err


def test_max_model_len_up_to_the_model_positions_runs(tmp_path):
    from experiments.lib.fidelity_spec import compose_cfg
    from experiments.lib.run_workload import run

    summary = run(compose_cfg([*SMALL, "progress=false", "plots=false", "scheduler.max_model_len=40960",
                              "blocks.kv_cache_gib=5"]), tmp_path)  # 3 GiB hold 28,080 tokens
    assert summary["completed"] == 5


def test_the_fidelity_goodput_slos_follow_the_run_slo_rule():
    from experiments.lib.fidelity_goodput import GoodputSpec

    section = {"slos": {"tight": {"ttft_s": 1.0, "tpot_s": -0.01}}, "comparisons": {"c": {"split": "a", "mixed": "b"}}}
    with pytest.raises(ValueError, match=r"spec s.yaml: goodput.slos.tight.tpot_s=-0.01 is invalid: must be a "
                                         r"number > 0 \(seconds\) or null"):
        GoodputSpec.parse(section, {"a": {}, "b": {}}, "s.yaml")


def test_gpu_memory_utilization_may_be_null_when_the_pool_is_sized_otherwise(tmp_path):
    from experiments.lib.fidelity_spec import compose_cfg
    from experiments.lib.run_workload import run

    cfg = compose_cfg([*SMALL, "progress=false", "plots=false", "blocks.gpu_memory_utilization=null"])  # kv_cache_gib=3
    assert run(cfg, tmp_path)["completed"] == 5


def test_the_model_shape_of_a_bad_tensor_parallel_size_names_the_parallel_key():
    from experiments.lib import factory
    from experiments.lib.fidelity_spec import compose_cfg

    with pytest.raises(ValueError, match=r"^parallel.tensor_parallel_size=0 is invalid"):
        factory.gpu_model_shape(compose_cfg(["parallel.tensor_parallel_size=0"]))


def test_a_capacity_with_no_failing_rate_is_a_lower_bound():
    import pandas as pd

    from experiments.lib.search.outputs import largest_capacity

    open_ended = pd.DataFrame({"capacity_rps": [16.0, 64.0], "failed_rps": [20.0, float("nan")]})
    assert largest_capacity(open_ended, 3) == ("the largest capacity is at least 64 req/s: no failing rate found "
                                               "within 3 iterations; raise search.rate.max_iterations")
    bracketed = pd.DataFrame({"capacity_rps": [16.0, 64.0], "failed_rps": [20.0, 70.0]})
    assert largest_capacity(bracketed, 3) == "the largest capacity is 64 req/s"


def test_the_engine_takes_a_null_gpu_memory_utilization_when_the_pool_is_sized_otherwise():
    from experiments.lib import engine_backend
    from experiments.lib.fidelity_spec import compose_cfg

    cfg = compose_cfg(["backend=engine", "model=tiny-llama", "scheduler.max_model_len=2048",
                       "blocks.num_gpu_blocks=200", "blocks.gpu_memory_utilization=null"])
    assert engine_backend.engine_args(cfg).gpu_memory_utilization == 0.9  # the engine's default; sizes nothing
    with pytest.raises(ValueError, match=r"blocks.gpu_memory_utilization=None is invalid: must be in \(0, 1\] "
                                         r"to size the KV pool from GPU memory"):
        engine_backend._memory_utilization({"gpu_memory_utilization": None})


@pytest.mark.parametrize("value", ["1.5", "0", "true"])
def test_the_engine_refuses_a_bad_gpu_memory_utilization_as_the_simulator_does(value):
    """One rule (policies/kv_pool_size.py): the same message on both backends, naming the config key."""
    from experiments.lib import engine_backend, factory
    from experiments.lib.fidelity_spec import compose_cfg

    cfg = compose_cfg(["backend=engine", "model=tiny-llama", "scheduler.max_model_len=2048",
                       "blocks.num_gpu_blocks=200", f"blocks.gpu_memory_utilization={value}"])
    with pytest.raises(ValueError, match=r"^blocks.gpu_memory_utilization=\S+ is invalid: must be in \(0, 1\]$") as sim:
        factory.kv_block_counts(cfg)
    with pytest.raises(ValueError) as engine:
        engine_backend.engine_args(cfg)
    assert str(engine.value) == str(sim.value)


def test_a_left_out_gpu_memory_utilization_is_the_default_on_both_backends():
    """A config without the key (`~blocks.gpu_memory_utilization`) sizes the pool from the default
    share on the simulator as the engine does, rather than one refusing what the other takes."""
    from experiments.lib import engine_backend, factory
    from experiments.lib.fidelity_spec import compose_cfg
    from policies.kv_pool_size import DEFAULT

    sized_from_memory = ["model=tiny-llama", "scheduler.max_model_len=2048", "blocks.kv_cache_gib=null"]
    cfg = compose_cfg([*sized_from_memory, "~blocks.gpu_memory_utilization"])
    assert "gpu_memory_utilization" not in cfg.blocks
    same = compose_cfg([*sized_from_memory, f"blocks.gpu_memory_utilization={DEFAULT}"])
    assert factory.kv_block_counts(cfg) == factory.kv_block_counts(same)
    assert engine_backend._memory_utilization(cfg.blocks) == DEFAULT  # what engine_args hands the engine
