"""The LM head in the `operators` latency model (sim/latency/operators.py) runs on a CUDA graph's
sample rows, padding included, as the engine's graphs compute it (engine/device/cuda_graph.py)."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from experiments.lib import factory
from experiments.profiles.synthetic_operators import synthetic_operator_profile
from sim.latency import BatchShape
from sim.latency.operator_profile import OperatorProfile, find_operator_files
from sim.latency.operators import OperatorModel

TOKEN_SIZES = [16, 32, 64, 128, 256, 512, 768, 1024]


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> OperatorProfile:
    out = tmp_path_factory.mktemp("ops")
    synthetic_operator_profile(factory.hardware(config()), out)
    return OperatorProfile.load(find_operator_files(out, "h200-roofline", "bfloat16"))


def config(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=["hardware=h200", *overrides])


def model(profile: OperatorProfile, name: str, max_num_seqs: int, tp: int = 1, graphs: bool = True) -> OperatorModel:
    cfg = config(f"model={name}", f"parallel.tensor_parallel_size={tp}")
    batch_sizes = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s <= max_num_seqs]
    return OperatorModel(profile, factory.model_shape(cfg), 16, tp,
                         batch_sizes=batch_sizes if graphs else None, token_sizes=TOKEN_SIZES if graphs else None)


def mixed(prefill: int, decodes: int, context: int) -> BatchShape:
    return BatchShape(prefill, 1, 0, prefill * (prefill + 1) // 2, decodes, decodes * context, decodes + 1, 0,
                      ((prefill, 0),))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_token_graph_computes_the_logits_of_min_tokens_max_num_seqs_rows(profile, tp):
    wide, narrow = model(profile, "qwen3-8b", 256, tp), model(profile, "qwen3-8b", 8, tp)
    step = mixed(500, 3, 400)  # 503 tokens run the 512-token graph: 256 or 8 logit rows, 4 sampled
    assert wide.logit_rows(512, step) == 256 and narrow.logit_rows(512, step) == 8
    extra = wide.lm_head(256) - narrow.lm_head(8)
    if tp > 1:
        extra += wide.all_gather(256 * wide.logit_bytes) - narrow.all_gather(8 * narrow.logit_bytes)
    assert extra > 0
    assert wide.shape_time(step) - narrow.shape_time(step) == pytest.approx(extra)


def test_a_decode_graph_computes_the_logits_of_its_batch_size(profile):
    graphs, eager = model(profile, "qwen3-0.6b", 256), model(profile, "qwen3-0.6b", 256, graphs=False)
    step = BatchShape(0, 0, 0, 0, 17, 17 * 600, 17)  # the 32-row graph
    assert graphs.logit_rows(32, step) == 32 and eager.logit_rows(17, step) == 17
    assert graphs.shape_time(step) - eager.shape_time(step) == pytest.approx(
        graphs.token_curve(32) - eager.token_curve(17) + graphs.lm_head(32) - eager.lm_head(17))


def test_an_eager_step_computes_the_logits_of_its_sampled_rows(profile):
    ops = model(profile, "qwen3-0.6b", 256)
    step = mixed(2000, 3, 400)  # past the largest token graph: eager
    assert ops.logit_rows(2003, step) == 4
