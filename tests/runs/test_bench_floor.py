"""bench_throughput's floors: the compute-aware one never undercuts the bytes-only one, and counts
the prefills' and decodes' FLOPs where they dominate."""
from __future__ import annotations

import pytest

from experiments.bench_throughput import StepCosts, compute_aware_floor_s, floor_bytes

COSTS = StepCosts(weight_bytes=16_000_000_000, kv_bytes_per_token=147_456, lm_head_params=622_329_856,
                  linear_params=6_945_767_424, attention_flops_per_pair=4 * 36 * 32 * 128)  # Qwen3-8B, bf16
PROMPTS, OUTPUTS = [100, 700, 1024, 333], [5, 100, 64, 1]


def test_without_compute_limits_the_floor_is_the_bytes_floor_plus_one_weight_pass():
    bytes_s = floor_bytes(PROMPTS, OUTPUTS, COSTS.weight_bytes, COSTS.kv_bytes_per_token) / 4e12
    prefill_s = (COSTS.weight_bytes + sum(PROMPTS) * COSTS.kv_bytes_per_token) / 4e12
    assert compute_aware_floor_s(PROMPTS, OUTPUTS, COSTS, 4e12, float("inf")) == pytest.approx(bytes_s + prefill_s)


def test_compute_bound_prefills_raise_the_floor_above_bytes():
    prompts, outputs = [4096] * 256, [2] * 256  # a prefill-heavy batch
    bytes_s = floor_bytes(prompts, outputs, COSTS.weight_bytes, COSTS.kv_bytes_per_token) / 4e12
    floor_s = compute_aware_floor_s(prompts, outputs, COSTS, 4e12, 7e14)
    prefill_flops = (2 * 4096 * 256 * COSTS.linear_params + 2 * 256 * COSTS.lm_head_params
                     + COSTS.attention_flops_per_pair * 256 * 4096 * 4097 // 2)
    assert floor_s >= prefill_flops / 7e14 > 10 * bytes_s


def test_a_large_decode_batch_is_floored_by_its_flops():
    prompts, outputs = [10] * 4096, [3] * 4096
    floor_s = compute_aware_floor_s(prompts, outputs, COSTS, 4e12, 1e14)
    decode_flops = 2 * 4096 * (COSTS.linear_params + COSTS.lm_head_params)
    assert floor_s >= 2 * decode_flops / 1e14


def test_step_costs_reads_a_real_engine():
    """The floors' inputs come from the engine's own model (kv bytes per token at the run's dtype)."""
    import torch

    from engine.engine_args import EngineArgs
    from engine.offline.llm_engine import LLMEngine
    from experiments.bench_throughput import step_costs

    engine = LLMEngine(EngineArgs(model="tiny-llama", num_gpu_blocks=16, max_model_len=128))
    costs = step_costs(engine, engine.runner.local_config, torch.float32)
    local = engine.runner.local_config
    assert costs.kv_bytes_per_token == 2 * local.num_hidden_layers * local.num_key_value_heads * local.head_dim * 4
    assert costs.weight_bytes > 0 and costs.linear_params > 0 and costs.lm_head_params > 0
