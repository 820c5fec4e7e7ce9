"""Operators at the shapes the engine's CUDA graphs launch them (engine/device/cuda_graph.py) in the
`operators` latency model (sim/latency/operators.py): the LM head on a graph's sample rows, padding
included, and decode attention split as the kernel splits a launch of the graph's decode rows."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from experiments.lib import factory
from experiments.profiles.synthetic_operators import synthetic_operator_profile
from sim.latency import BatchShape
from sim.latency.operator_profile import OperatorProfile, find_operator_files
from sim.latency.operators import OperatorModel

OPERATORS = Path(__file__).resolve().parents[2] / "experiments" / "profiles" / "operators"

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
    extra = wide.lm_head(256) - narrow.lm_head(8)  # the exchange (tp > 1) is of the 4 sampled rows in both
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


def one_split_from_65_programs(programs: int, slots: int, table_tokens: int) -> int:
    """A split rule for the tests: 16 splits up to 64 programs, one above."""
    assert slots == 528 and table_tokens == 4096
    return 16 if programs <= 64 else 1


@pytest.fixture(scope="module")
def h200() -> OperatorProfile:
    return OperatorProfile.load(find_operator_files(OPERATORS, "h200", "bfloat16"))


def split_model(profile: OperatorProfile, rule=one_split_from_65_programs) -> OperatorModel:
    shape_ = factory.model_shape(config("model=qwen3-0.6b"))  # 8 KV heads: one sequence is 8 programs
    return OperatorModel(profile, shape_, 16, batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                         token_sizes=TOKEN_SIZES, decode_wave_programs=528, decode_splits=rule, max_model_len=4096)


def test_a_decode_in_a_token_graph_runs_at_the_split_count_of_the_graphs_rows(h200):
    ops, plain = split_model(h200), split_model(h200, rule=None)
    assert ops.decode_pricing.lone_splits == 16
    step = mixed(1000, 1, 1500)  # the 1024-token graph launches 256 decode rows: one split
    assert ops.decode_attention(step, 1024) == pytest.approx(ops.decode_pricing.decode(1, 1500 * 16))
    layers = ops.model.num_hidden_layers
    assert ops.shape_time(step) - plain.shape_time(step) == pytest.approx(
        layers * (ops.decode_pricing.decode(1, 1500 * 16) - ops.decode_pricing.decode(1, 1500)))
    assert ops.shape_time(step) > 1.1 * plain.shape_time(step)


def test_a_decode_graph_split_as_the_profiles_rows_is_priced_as_before(h200):
    ops, plain = split_model(h200), split_model(h200, rule=None)
    for n in (1, 4, 8):  # graphs of 8-64 programs: 16 splits, as the one-sequence rows
        step = BatchShape(0, 0, 0, 0, n, n * 900, n, 0, (), 900)
        assert ops.shape_time(step) == plain.shape_time(step)


def test_the_built_model_takes_the_engines_split_rule():
    built = factory.build_latency(config("latency=operators", "model=qwen3-0.6b"))
    assert built.decode_pricing.split_rule(8, 528, 4096) == built.decode_pricing.lone_splits == 16
    assert built.decode_pricing.split_rule(256 * 8, 528, 4096) == 1 and built.decode_pricing.table_tokens == 4096


def test_the_priced_block_tables_are_as_wide_as_the_engines():
    """The kernels' split count follows the block tables' width, which the engine rounds up to a
    multiple of 16 columns (policies/block_table_width.py): 1,000 tokens of 16-token blocks is 63
    blocks, 64 columns."""
    built = factory.build_latency(config("latency=operators", "model=qwen3-0.6b", "scheduler.max_model_len=1000"))
    assert built.decode_pricing.table_tokens == 64 * 16
