"""The roofline prices the engine's sequence-parallel steps (`parallel.sequence_parallel_min_rows`,
sim/latency/sequence_parallel_roofline.py): the same bytes on the links as the all-reduce path, in
4 L + 2 collectives instead of 2 L + 1, the norms on each GPU's rows, the fused boundaries hidden
behind their GEMMs; graphed decode batches and steps below the setting keep the all-reduce path."""
from __future__ import annotations

import pytest

from experiments.lib import factory
from experiments.lib.backends import run_sim
from policies.trace import TraceRecorder
from sim.latency.base import BatchShape
from sim.latency.sequence_parallel_roofline import NORM_ELEMENTS_PER_LAYER
from sim.latency.tensor_parallel import RingLink
from tests.simulation.test_latency_operators_fused_boundary import config, decode, prefill

BASE = ("latency=roofline", "hardware=h200", "model=qwen3-8b", "parallel.tensor_parallel_size=2")
SP = "parallel.sequence_parallel_min_rows=2048"
PLAIN = "parallel.disable_custom_all_reduce=true"  # no symmetric memory: the boundaries not fused


def roofline(*overrides: str):
    return factory.build_latency(config(*BASE, *overrides))


def test_steps_below_the_setting_and_graphed_decodes_keep_the_all_reduce_path():
    off, sp = roofline(), roofline(SP)
    assert sp.sequence_parallel is not None and off.sequence_parallel is None
    for shape in (prefill(2047), prefill(16), decode(256), BatchShape(1500, 2, 0, 10**6, 256, 10**5, 258)):
        assert sp.shape_time(shape) == off.shape_time(shape)
    # A decode batch of 2048 replays no graph (max_num_seqs is 256), so it runs sequence-parallel;
    # one of 256 replays its graph even where the setting is below it, a prefill step of 256 does not.
    big = decode(2048)
    assert sp.shape_time(big) != off.shape_time(big)
    low = roofline("parallel.sequence_parallel_min_rows=128")
    assert low.shape_time(decode(256)) == off.shape_time(decode(256))
    assert low.shape_time(prefill(256)) != off.shape_time(prefill(256))
    assert roofline("parallel.tensor_parallel_size=1", SP).sequence_parallel is None  # one GPU: nothing to split


def test_the_plain_path_moves_the_all_reduce_bytes_in_twice_the_collectives():
    """Not fused: the step differs from the all-reduce path's by the norms on half the rows and one
    more link latency per collective (4 L + 2 of them against 2 L + 1)."""
    off, sp = roofline(PLAIN), roofline(PLAIN, SP)
    model, hw = factory.model_shape(config(*BASE)), factory.hardware(config(*BASE))
    layers, h, b = model.num_hidden_layers, model.hidden_size, model.dtype_bytes
    link = RingLink.of(hw, 2)
    bw = hw.hbm_bandwidth * hw.bandwidth_efficiency
    for tokens in (2048, 4096, 8192):
        norms_saved = tokens / 2 * layers * NORM_ELEMENTS_PER_LAYER * h * b / bw
        expected = off.shape_time(prefill(tokens)) - norms_saved + (2 * layers + 1) * link.latency_s
        assert sp.shape_time(prefill(tokens)) == pytest.approx(expected, rel=1e-12)
    # An odd step pads to a multiple of the GPUs: its GEMMs and collectives run one row more.
    assert sp.shape_time(prefill(4097)) > sp.shape_time(prefill(4096))


def test_fused_boundaries_hide_behind_their_gemms():
    """With symmetric memory the four boundaries of a layer cost only what their collectives take
    beyond their GEMMs: at prefill sizes on H200s every GEMM is longer than its exchange, so the
    step pays the embedding's and the final norm's collectives alone."""
    plain, fused = roofline(PLAIN, SP), roofline(SP)
    assert fused.sequence_parallel.fused and not plain.sequence_parallel.fused
    model, hw = factory.model_shape(config(*BASE)), factory.hardware(config(*BASE))
    layers = model.num_hidden_layers
    link = RingLink.of(hw, 2)
    for tokens in (2048, 8192):
        c = link.all_gather_s(tokens * model.hidden_size * model.dtype_bytes)
        saved = plain.shape_time(prefill(tokens)) - fused.shape_time(prefill(tokens))
        assert saved == pytest.approx(4 * layers * c, rel=1e-9)
    # A slow link leaves part of each exchange exposed: the fused path then costs more than the
    # hidden case but never more than the plain one.
    slow = ("hardware.interconnect_bandwidth=1e9",)
    slow_plain, slow_fused, hidden = roofline(PLAIN, SP, *slow), roofline(SP, *slow), fused
    t = prefill(4096)
    assert hidden.shape_time(t) < slow_fused.shape_time(t) < slow_plain.shape_time(t)


def test_a_run_prices_it_and_bad_values_are_refused():
    """A whole simulated run at TP=2 takes the setting (its long prefills priced sequence-parallel)."""
    overrides = ("workload=offline", "workload.num_requests=24", "workload.prompt_len.low=2500",
                 "workload.prompt_len.high=4000", "workload.output_len.low=4", "workload.output_len.high=8")
    runs = []
    for extra in ((SP,), ()):
        cfg = config(*BASE, *overrides, *extra)
        recorder = TraceRecorder()
        runs.append((run_sim(cfg, factory.workload(cfg), recorder, lambda n: None), recorder))
    (on, on_rec), (off, off_rec) = runs
    assert len(on_rec.requests) == len(off_rec.requests) == 24
    assert on.num_steps == off.num_steps and on.elapsed_s != off.elapsed_s
    for bad, shown in (("-1", "-1"), ("true", "True"), ("1.5", "1.5")):
        with pytest.raises(ValueError, match=rf"sequence_parallel_min_rows={shown} is invalid: an integer >= 0"):
            roofline(f"parallel.sequence_parallel_min_rows={bad}")
