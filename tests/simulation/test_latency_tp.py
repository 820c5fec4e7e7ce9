"""The simulator's tensor-parallel pricing: per-GPU shapes, the all-reduce and gather terms worked by
hand, profiles checked for their size, and `parallel.tensor_parallel_size` in a run config."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from experiments.lib import factory
from sim.latency import BatchShape, Hardware, ModelShape, ProfiledModel, RooflineModel
from sim.latency.tensor_parallel import TPCommCost, shard_shape

ROOT = Path(__file__).resolve().parents[2]
# 2 layers, hidden 64, 4 heads x 16, 2 KV heads, inter 128, vocab 256, bf16 (2 B).
MODEL = ModelShape.from_dict({"name": "toy", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "vocab_size": 256, "dtype": "bfloat16"})
HW = {"name": "toy-gpu", "memory_gib": 1, "hbm_bandwidth": 1e12, "bf16_flops": 1e14, "fp32_flops": 1e13,
      "host_link_bandwidth": 1e9, "bandwidth_efficiency": 1.0, "gemm_efficiency": 1.0, "attention_efficiency": 1.0,
      "step_overhead_s": 1e-3, "swap_latency_s": 1e-5, "swap_block_overhead_s": 1e-6,
      "interconnect_bandwidth": 1e9, "interconnect_latency_s": 1e-6}


def test_shard_shape_is_one_gpus_share():
    four = shard_shape(MODEL, 4)
    assert (four.num_attention_heads, four.num_key_value_heads, four.intermediate_size, four.vocab_size) == (1, 1, 32, 64)
    assert four.kv_bytes_per_token == 2 * 2 * 1 * 16 * 2  # one replicated KV head per GPU
    assert shard_shape(MODEL, 1) is MODEL
    with pytest.raises(ValueError, match="num_attention_heads=4 .* tensor_parallel_size=3"):
        shard_shape(MODEL, 3)


def test_all_reduce_and_gather_terms_by_hand():
    # N = 4 over 1 GB/s and 1 us: (2 L + 1) = 5 all-reduces of T x 64 x 2 B, ring factor 2 * 3/4,
    # and one gather of R x 4 ranks x 8 B (each rank's best score and column), ring factor 3/4;
    # 6 collectives' latency.
    comm = TPCommCost.of(MODEL, Hardware.from_dict(HW), 4)
    assert comm.fixed_s == pytest.approx(6e-6)
    assert comm.per_token_s == pytest.approx(5 * 1.5 * 128 / 1e9)  # 0.96 us per token
    assert comm.per_sample_s == pytest.approx(0.75 * 32 / 1e9)  # 0.024 us per sampled row
    # 10 tokens, 3 sampled: 6 us + 9.6 us + 0.072 us
    assert comm.step_s(10, 3) == pytest.approx(15.672e-6)
    assert TPCommCost.of(MODEL, Hardware.from_dict(HW), 1).step_s(10, 3) == 0.0
    two = TPCommCost.of(MODEL, Hardware.from_dict(HW), 2)  # ring factor 2 * 1/2 = 1
    assert two.per_token_s == pytest.approx(5 * 128 / 1e9)


def test_roofline_prices_one_gpu_plus_communication():
    hw = Hardware.from_dict(HW)
    tp = RooflineModel(MODEL, hw, 16, tensor_parallel_size=2)
    one_gpu = RooflineModel(shard_shape(MODEL, 2), hw, 16)
    comm = TPCommCost.of(MODEL, hw, 2)
    for shape in (BatchShape(0, 0, 0, 0, 8, 800, 8, 0), BatchShape(100, 1, 0, 5050, 4, 400, 5, 0)):
        tokens = shape.num_prefill_tokens + shape.num_decode_seqs
        assert tp.shape_time(shape) == pytest.approx(one_gpu.shape_time(shape) + comm.step_s(tokens, shape.num_samples))
    # Consecutive decode steps priced in one go equal step by step, communication included.
    fast = tp.decode_times(8, 800, 8, 5)
    assert fast == [tp.shape_time(BatchShape(0, 0, 0, 0, 8, 800 + 8 * s, 8, 0)) for s in range(5)]
    assert tp.block_bytes == 16 * shard_shape(MODEL, 2).kv_bytes_per_token


def test_tensor_parallelism_needs_the_link_figures():
    bare = {k: v for k, v in HW.items() if not k.startswith("interconnect")}
    RooflineModel(MODEL, Hardware.from_dict(bare), 16)  # one GPU: not needed
    with pytest.raises(ValueError, match="interconnect_bandwidth"):
        RooflineModel(MODEL, Hardware.from_dict(bare), 16, tensor_parallel_size=2)


def test_a_profile_of_another_size_is_refused(tmp_path):
    text = (ROOT / "experiments/profiles/example-synthetic.csv").read_text()
    (tmp_path / "p1.csv").write_text(text)  # no tensor_parallel_size: measured on one GPU
    tp2 = tmp_path / "p2.csv"
    tp2.write_text("# tensor_parallel_size: 2\n" + text)
    assert ProfiledModel(tp2, 16, tensor_parallel_size=2).meta["tensor_parallel_size"] == "2"
    with pytest.raises(ValueError, match="measured with tensor_parallel_size=2, not parallel.tensor_parallel_size=1"):
        ProfiledModel(tp2, 16)
    with pytest.raises(ValueError, match="tensor_parallel_size=1, not parallel.tensor_parallel_size=4"):
        ProfiledModel(tmp_path / "p1.csv", 16, tensor_parallel_size=4)


def _cfg(*overrides):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=["model=llama-3.1-70b", "blocks.kv_cache_gib=null", *overrides])


def test_run_config_sizes_kv_per_gpu_and_names_profiles():
    with pytest.raises(ValueError, match="no block fits"):  # 141 GB of weights on one H200
        factory.kv_block_counts(_cfg())
    gpu2, _ = factory.kv_block_counts(_cfg("parallel.tensor_parallel_size=2"))
    gpu8, _ = factory.kv_block_counts(_cfg("parallel.tensor_parallel_size=8"))
    assert 0 < gpu2 < gpu8  # more of each GPU left for KV, and each block smaller (one KV head)
    assert factory.build_latency(_cfg("parallel.tensor_parallel_size=8")).tensor_parallel_size == 8
    with pytest.raises(ValueError, match="parallel.tensor_parallel_size=0"):
        factory.build_latency(_cfg("parallel.tensor_parallel_size=0"))
    with pytest.raises(ValueError, match="num_attention_heads=64 .* tensor_parallel_size=3"):
        factory.kv_block_counts(_cfg("parallel.tensor_parallel_size=3"))
    path = _cfg("latency=profiled", "parallel.tensor_parallel_size=8").latency.path
    assert path.endswith("h200-llama-3.1-70b-tp8-async.csv")  # async scheduling: the default
    assert _cfg("latency=profiled").latency.path.endswith("h200-llama-3.1-70b-async.csv")
