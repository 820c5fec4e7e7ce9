"""A run's KV pool is one the engine would start with: set explicitly, it fits beside the weights
and activations in the simulated GPU's memory; however sized, it holds one max_model_len sequence
(experiments/lib/kv_pool.py, policies/kv_pool_size.py). Refused at config time on both backends."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.lib import factory
from experiments.lib.engine_backend import engine_args
from experiments.lib.fidelity_spec import compose_cfg
from policies.blocks.base import fits_idle_pool
from tests.property_settings import examples

ENGINE_ON_CPU = ["backend=engine", "backend.device=cpu"]


def counts(*overrides: str) -> tuple[int, int]:
    return factory.kv_block_counts(compose_cfg(list(overrides)))


def test_a_pool_that_cannot_hold_one_max_model_len_sequence_is_refused():
    with pytest.raises(ValueError, match=r"blocks.num_gpu_blocks=5 is invalid: its KV pool of 5 x 16-token blocks "
                                         r"cannot hold one scheduler.max_model_len=4096 sequence, which takes 256 of "
                                         r"them: set it to at least 256, or lower scheduler.max_model_len"):
        counts("blocks.num_gpu_blocks=5")
    assert counts("blocks.num_gpu_blocks=256")[0] == 256
    assert counts("blocks.num_gpu_blocks=5", "scheduler.max_model_len=80")[0] == 5
    # Qwen3-0.6B: 256 blocks of 16 tokens x 112 KiB per token are 0.4375 GiB
    with pytest.raises(ValueError, match=r"blocks.kv_cache_gib=0.01 is invalid: .* set it to at least 0.438,"):
        counts("blocks.kv_cache_gib=0.01")
    assert counts("blocks.kv_cache_gib=0.438")[0] == 256
    with pytest.raises(ValueError, match=r"blocks.gpu_memory_utilization=0.12 is invalid: its KV pool of \d+ x 16-token "
                                         r"blocks .* scheduler.max_model_len=40960 sequence, which takes 2560 of them: "
                                         r"set it to at least 0.151,"):
        counts("model=qwen3-8b", "blocks.kv_cache_gib=null", "blocks.gpu_memory_utilization=0.12",
               "scheduler.max_model_len=40960")


@settings(max_examples=examples(15), deadline=None)
@given(st.integers(1, 600), st.sampled_from([8, 16, 32]), st.integers(2, 8192))
def test_the_simulator_accepts_exactly_the_pools_admission_can_fill(num_gpu_blocks, block_size, max_model_len):
    overrides = (f"blocks.num_gpu_blocks={num_gpu_blocks}", f"blocks.block_size={block_size}",
                 f"scheduler.max_model_len={max_model_len}")
    if fits_idle_pool(max_model_len, block_size, num_gpu_blocks):
        assert counts(*overrides)[0] == num_gpu_blocks
    else:
        with pytest.raises(ValueError, match=rf"blocks.num_gpu_blocks={num_gpu_blocks} is invalid"):
            counts(*overrides)


def test_the_engine_backend_refuses_the_same_pools_before_it_loads():
    with pytest.raises(ValueError, match=r"blocks.num_gpu_blocks=5 is invalid: .* set it to at least 256"):
        engine_args(compose_cfg([*ENGINE_ON_CPU, "blocks.num_gpu_blocks=5"]))
    # the engine's blocks on the CPU are float32, twice the simulated GPU's bfloat16: twice the GiB
    with pytest.raises(ValueError, match=r"blocks.kv_cache_gib=0.438 is invalid: .* set it to at least 0.875"):
        engine_args(compose_cfg([*ENGINE_ON_CPU, "blocks.kv_cache_gib=0.438"]))
    assert engine_args(compose_cfg([*ENGINE_ON_CPU, "blocks.num_gpu_blocks=256"])).num_gpu_blocks == 256


def test_an_explicit_pool_must_fit_beside_the_weights_in_the_gpus_memory():
    seventy = ("model=llama-3.1-70b", "hardware=h200")
    with pytest.raises(ValueError, match=r"blocks.kv_cache_gib=50 is invalid: model=llama-3.1-70b's weights "
                                         r"\(131.42 GiB per GPU at parallel.tensor_parallel_size=1\) and activations "
                                         r"\(0.47 GiB\) with a KV pool of 50.00 GiB exceed hardware h200's 140.4 GiB "
                                         r"of memory: set it to at most 8.517"):
        counts(*seventy, "blocks.kv_cache_gib=50")
    with pytest.raises(ValueError, match=r"blocks.num_gpu_blocks=100000 is invalid: .* set it to at most 1744$"):
        counts(*seventy, "blocks.kv_cache_gib=null", "blocks.num_gpu_blocks=100000")
    # 131.4 GiB of weights, 0.5 of activations and 3 of KV fit in the H200's 140.4 GiB, not the A100's 80
    assert counts(*seventy)[0] > 0
    with pytest.raises(ValueError, match=r"exceed hardware a100's 80 GiB of memory: raise "
                                         r"parallel.tensor_parallel_size, or pick hardware with more memory"):
        counts("model=llama-3.1-70b", "hardware=a100")
    assert counts("model=llama-3.1-70b", "hardware=a100", "parallel.tensor_parallel_size=2")[0] > 0
