"""Roofline latency model: hand-computed step and swap times."""
from pathlib import Path

import pytest
import yaml

from policies import Scheduler, SchedulerConfig, make_block_manager, make_policy
from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.request import Request, SamplingParams
from policies.sequence import Sequence
from sim.latency import BatchShape, Hardware, ModelShape, RooflineModel

# hidden 64, 2 layers, 4 heads x 16, 2 KV heads, inter 128, vocab 256, bf16:
#   linear params/layer = 64*(64+2*32) + 64*64 + 3*64*128 = 36864 -> 73728 for 2 layers
#   step weight bytes   = (73728 + 256*64) * 2 = 180224
#   KV bytes/token      = 2 * 2 layers * 2 heads * 16 * 2 B = 256
#   activation bytes/token = 2 layers * (8*64 + 5*128) * 2 B = 4608
#   attention FLOPs/pair   = 4 * 2 * 4 * 16 = 512
ROOT = Path(__file__).resolve().parents[2]
MODEL = {"name": "toy", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "tie_word_embeddings": False, "dtype": "bfloat16"}
HW = {"name": "toy-gpu", "memory_gib": 1, "hbm_bandwidth": 1e12, "bf16_flops": 1e14, "fp32_flops": 1e13,
          "host_link_bandwidth": 1e9, "bandwidth_efficiency": 1.0, "gemm_efficiency": 1.0, "attention_efficiency": 1.0,
          "step_overhead_s": 1e-3, "swap_latency_s": 1e-5, "swap_block_overhead_s": 1e-6}


def model(**kw) -> RooflineModel:
    return RooflineModel(ModelShape.from_dict(MODEL), Hardware.from_dict({**HW, **kw}), block_size=16)


def seq(prompt_len: int, computed: int, seq_id: int = 0) -> Sequence:
    req = Request(str(seq_id), list(range(prompt_len)), SamplingParams(max_tokens=8))
    s = Sequence.from_request(seq_id, req)
    s.num_computed_tokens = computed
    return s


def out_of(*entries) -> SchedulerOutput:
    return SchedulerOutput(0.0, scheduled=[ScheduledSeq(*e) for e in entries])


def test_shape_arithmetic():
    m = ModelShape.from_dict(MODEL)
    assert m.linear_params == 73728
    assert m.step_weight_bytes == 180224
    assert m.kv_bytes_per_token == 256
    assert m.activation_bytes_per_token == 4608
    assert m.attention_flops_per_pair == 512


def test_decode_is_memory_bound():
    # one decode with 99 cached tokens: reads 100 KV entries; GEMM FLOPs (2*73728 + 2*16384 = 180224)
    # take 1.8 ns at 1e14, far under the 180 ns of weight reads.
    t = model().step_time(out_of((seq(99, 99), 1, 1)))
    expected = 1e-3 + 180224 / 1e12 + 4608 / 1e12 + 100 * 256 / 1e12
    assert t == pytest.approx(expected, rel=1e-12)


def test_prefill_chunk_over_prefix():
    # a 10-token chunk after 6 computed tokens: KV = 6 read + 10 written; pairs = 10*6 + 55 = 115
    rm = model(bf16_flops=1e9)  # slow FLOPs: every phase is compute bound
    t = rm.step_time(out_of((seq(16, 6), 10, 1)))
    gemm = (2 * 73728 * 10 + 2 * 16384 * 1) / 1e9
    expected = 1e-3 + gemm + 10 * 4608 / 1e12 + 115 * 512 / 1e9
    assert t == pytest.approx(expected, rel=1e-12)


def test_mixed_batch_phases_add_up():
    rm = model()
    o = out_of((seq(50, 49, 0), 1, 1), (seq(30, 29, 1), 1, 1), (seq(200, 0, 2), 128, 0))
    b = BatchShape.of(o)
    assert (b.num_decode_seqs, b.num_context_tokens, b.num_prefill_tokens, b.num_samples) == (2, 80, 128, 2)
    assert b.prefill_attention_pairs == 128 * 129 // 2
    tokens = 130
    gemm = max(180224 / 1e12, (2 * 73728 * tokens + 2 * 16384 * 2) / 1e14)
    decode = max(80 * 256 / 1e12, 80 * 512 / 1e14)
    prefill = max(128 * 256 / 1e12, (128 * 129 // 2) * 512 / 1e14)
    expected = 1e-3 + gemm + tokens * 4608 / 1e12 + decode + prefill
    assert rm.step_time(o) == pytest.approx(expected, rel=1e-12)


def test_scheduler_totals_give_the_shape_of_the_entries():
    # The scheduler keeps out.sum_* while building a batch (decode context from its running total):
    # the shape must be the one the entries give, through chunked prefills, mixed and decode-only steps.
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), make_policy("fcfs"),
                      make_block_manager("paged", 16, 100, 0, 0.0, 4096))
    for i, prompt_len in enumerate((40, 70, 5)):
        sched.add(Request(str(i), list(range(prompt_len)), SamplingParams(max_tokens=20, ignore_eos=True)), 0.0)
    for step in range(8):
        out = sched.schedule(float(step))
        bare = SchedulerOutput(out.now, scheduled=list(out.scheduled), copy=list(out.copy))
        assert out.sum_new_tokens is not None and BatchShape.of(out) == BatchShape.of(bare)
        sched.update(out, {e.seq.seq_id: [1] * e.num_samples for e in out.scheduled if e.num_samples}, step + 0.5)
    assert BatchShape.of(out).num_prefill_tokens == 0  # the last steps were decode-only


def test_efficiency_factors_scale_times():
    base = model(step_overhead_s=0.0).step_time(out_of((seq(99, 99), 1, 1)))
    slow = model(step_overhead_s=0.0, bandwidth_efficiency=0.5).step_time(out_of((seq(99, 99), 1, 1)))
    assert slow == pytest.approx(2 * base)


def test_empty_step_costs_nothing_and_copies_cost_bandwidth():
    rm = model()
    assert rm.step_time(SchedulerOutput(0.0)) == 0.0
    o = SchedulerOutput(0.0, copy=[(1, 2), (3, 4)])
    assert rm.step_time(o) == pytest.approx(1e-3 + 2 * 2 * 16 * 256 / 1e12)


def test_swap_time_and_total_time():
    rm = model()
    block_bytes = 16 * 256
    assert rm.swap_time(0) == 0.0
    assert rm.swap_time(10) == pytest.approx(1e-5 + 10 * (block_bytes / 1e9 + 1e-6))
    o = out_of((seq(99, 99), 1, 1))
    o.swap_out = {1: 0, 2: 1}
    o.swap_in = {5: 7}
    assert rm.total_time(o) == pytest.approx(rm.step_time(o) + rm.swap_time(2) + rm.swap_time(1))


def test_qwen3_parameter_count():
    # Qwen3-0.6B has 596,049,920 parameters; we leave out its 28 x 2 x 128 q/k-norm weights.
    shape = ModelShape.from_dict(yaml.safe_load((ROOT / "conf/model/qwen3-0.6b.yaml").read_text()))
    assert shape.num_params == 596_049_920 - 28 * 2 * 128
    assert shape.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2


def test_bad_hardware_and_model_name_the_key():
    with pytest.raises(ValueError, match=r"hardware.gemm_efficiency=0 is invalid"):
        Hardware.from_dict({**HW, "gemm_efficiency": 0})
    with pytest.raises(ValueError, match=r"hardware.hbm_bandwidth is missing"):
        Hardware.from_dict({k: v for k, v in HW.items() if k != "hbm_bandwidth"})
    with pytest.raises(ValueError, match=r"model.dtype='int3' is invalid"):
        ModelShape.from_dict({**MODEL, "dtype": "int3"})
