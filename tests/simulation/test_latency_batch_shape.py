"""The batch-shape axis of profiles: a decode step whose kernel time follows the batch's longest
context (a program-per-sequence kernel on a one-wave batch) is priced from rows measured at that
ratio of longest to mean context; profiles without the axis price every step as before."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from experiments.lib.profiling.grid import ProfileGrid
from experiments.lib.profiling.synthetic import decode_contexts
from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.request import Request, SamplingParams
from policies.sequence import Sequence
from sim.latency.base import BatchShape
from sim.latency.profiled import ProfiledModel

ROOT = Path(__file__).resolve().parents[2]
# Prices of the committed profiles before the axis existed (float.hex; compared to 1e-12 relative, since
# the last bits follow the numpy/pandas build's summation order): SHAPES through
# shape_time (then sync=True where the profile has a sync grid), decode_times(64, 64 * 800, 64, 3),
# swap_time(5) and swap_time(700).
SHAPES = [BatchShape(0, 0, 0, 0, 37, 37 * 700, 37), BatchShape(0, 0, 0, 0, 1, 3000, 1),
          BatchShape(300, 2, 500, 300 * 250 + 300 * 301 // 2, 20, 20 * 900, 22, 0, ((100, 0), (200, 500))),
          BatchShape(1500, 1, 0, 1500 * 1501 // 2, 200, 200 * 1500, 201, 0, ((1500, 0),)),
          BatchShape(0, 0, 0, 0, 256, 256 * 4500, 256)]
ASYNC = ['0x1.1fdd6554d13a2p-9', '0x1.9885787a6520fp-10', '0x1.d8059f257b758p-9', '0x1.e38c01f362ac5p-7',
         '0x1.01a5cd291041cp-5', '0x1.6706337bd1895p-9', '0x1.e5f9f5578e0efp-10', '0x1.0046bf31d7be7p-8',
         '0x1.05f01dbacbc1bp-6', '0x1.1afd3d1b35752p-5', '0x1.85572d2bd9266p-9', '0x1.858eae03c5aa5p-9',
         '0x1.85c62edbb22e4p-9', '0x1.dad1d8cfa8a74p-12', '0x1.9f147576016c9p-6']
GOLDEN = {
    "h200-qwen3-0.6b": ['0x1.5726a0b3d7420p-9', '0x1.ddd28084b97c7p-10', '0x1.17c8b34f82600p-8',
                        '0x1.0c9b191b7f778p-6', '0x1.286f4f1369f29p-5', '0x1.cebfdb7848083p-9',
                        '0x1.cefcdb33906b2p-9', '0x1.cf39daeed8ce2p-9', '0x1.e537c736297c4p-12',
                        '0x1.a5ce7386f1878p-6'],
    "h200-qwen3-0.6b-async-packed": ASYNC,
    "example-synthetic": ['0x1.c3fbed5ba8dcap-10', '0x1.f07360e371a4ap-11', '0x1.d28e8b5214b99p-10',
                          '0x1.e1d1700b15cc2p-7', '0x1.440d3cb05a21cp-5', '0x1.51e826ff2016ap-9',
                          '0x1.522fbf99847a8p-9', '0x1.52775833e8de6p-9', '0x1.9245fe1dce69fp-13',
                          '0x1.8a7063a372196p-6'],
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_committed_profiles_without_the_axis_price_as_before(name):
    m = ProfiledModel(ROOT / f"experiments/profiles/{name}.csv", 16)
    assert not m.uses_longest_context
    longest = [dataclasses.replace(s, max_context_tokens=5000) for s in SHAPES]
    for shapes in (SHAPES, longest):  # a known longest context changes nothing without the axis
        got = [m.shape_time(s) for s in shapes]
        if m.sync_grid is not None:
            got += [m.shape_time(s, sync=True) for s in shapes]
        got += m.decode_times(64, 64 * 800, 64, 3) + [m.swap_time(5), m.swap_time(700)]
        assert [float(x) for x in got] == pytest.approx([float.fromhex(h) for h in GOLDEN[name]], rel=1e-12)


@given(d=st.integers(1, 300), c=st.integers(2, 4096), ratio=st.floats(1.0, 8.0))
def test_ragged_contexts_have_the_asked_longest_and_total(d, c, ratio):
    lens = decode_contexts(d, c, ratio)
    assert len(lens) == d and sum(lens) == d * c and min(lens) >= 2
    assert lens[-1] == max(lens)
    if d > 1:
        assert lens[-1] == min(max(round(ratio * c), c), d * c - 2 * (d - 1))


def _profile(path: Path, slow: float) -> Path:
    """Decode rows at ratios 1 and 4: at 4 the step costs `slow` x the ratio-1 time; prefill rows
    carry no ratio (they stand for every one)."""
    lines = ["# model: m", "# block_size: 16",
             "kind,num_prefill_tokens,num_decode_seqs,num_context_tokens,num_blocks,time_s,context_ratio"]
    for p in (0, 512):
        for d in (0, 8, 32):
            for c in ((64, 1024) if d else (0,)):
                base = 1e-3 + p * 1e-6 + d * c * 1e-8
                if p == 0 and d:
                    lines += [f"step,{p},{d},{d * c},,{base},1", f"step,{p},{d},{d * c},,{base * slow},4"]
                elif p or d:
                    lines.append(f"step,{p},{d},{d * c},,{base},")
    lines += ["step,0,0,0,,1e-3,", "swap,,,,1,1e-4,", "swap,,,,64,1e-3,"]
    path.write_text("\n".join(lines) + "\n")
    return path


def _decodes(contexts: list[int]) -> SchedulerOutput:
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    scheduled = []
    for i, n in enumerate(contexts):
        seq = Sequence.from_request(i, Request(f"r{i}", list(range(n)), params))
        seq.num_computed_tokens = n - 1  # reads n entries, its new token included
        scheduled.append(ScheduledSeq(seq, 1, 1))
    return SchedulerOutput(now=0.0, scheduled=scheduled)


def test_a_step_whose_longest_context_dominates_is_priced_from_the_ratio_rows(tmp_path):
    m = ProfiledModel(_profile(tmp_path / "p.csv", slow=3.0), 16)
    assert m.uses_longest_context and m.axes.ratio == [1.0, 4.0]
    even = m.step_time(_decodes([1024] * 8))  # ratio 1
    ragged = m.step_time(_decodes([4096] + [585] * 6 + [586]))  # same total (8192), longest 4 x the mean
    assert even == pytest.approx(1e-3 + 8 * 1024 * 1e-8)
    assert ragged == pytest.approx(3 * even)
    assert m.step_time(_decodes([2560] + [804] * 6 + [808])) == pytest.approx(2 * even)  # ratio 2.5: halfway
    assert m.lookup(0, 8, 8192) == pytest.approx(even * (1 + 2 * 0.75 / 3))  # not known: the 7/4 spread
    # Rows without a ratio stand for every ratio: a step with prefill is priced as before.
    mixed = BatchShape(512, 1, 0, 512 * 513 // 2, 8, 8192, 9, 0, ((512, 0),), 4096)
    assert m.shape_time(mixed) == pytest.approx(1e-3 + 512e-6 + 8192e-8)


def test_decode_runs_grow_the_longest_context_as_steps_do(tmp_path):
    m = ProfiledModel(_profile(tmp_path / "p.csv", slow=3.0), 16)
    run = m.decode_times(8, 8 * 700, 8, 4, max_context_tokens=2000)
    assert run == [m.shape_time(BatchShape(0, 0, 0, 0, 8, 8 * 700 + 8 * s, 8, 0, (), 2000 + s)) for s in range(4)]
    assert run[0] > m.decode_times(8, 8 * 700, 8, 1)[0]  # 2000 / 700 is past the unknown 7/4


def test_grid_measures_every_ratio_on_decode_only_rows_only():
    grid = ProfileGrid.from_dict({"prefill_tokens": [0, 8], "decode_seqs": [0, 1, 4], "context_per_decode": [8],
                                  "swap_blocks": [1], "split_prefill_tokens": [8], "split_counts": [1],
                                  "context_ratios": [3, 1]})
    shapes = {(s.num_prefill_tokens, s.num_decode_seqs, s.context_ratio) for s in grid.step_shapes()}
    assert shapes == {(0, 1, None), (0, 4, 1.0), (0, 4, 3.0), (8, 0, None), (8, 1, None), (8, 4, None)}
    with pytest.raises(ValueError, match=r"profile_grid.context_ratios=\[0.5\] is invalid"):
        ProfileGrid.from_dict({"prefill_tokens": [0], "decode_seqs": [1], "context_per_decode": [8],
                               "swap_blocks": [1], "split_prefill_tokens": [8], "split_counts": [1],
                               "context_ratios": [0.5]})


def test_default_grid_measures_both_sides_of_the_tma_kernels_first_split_change():
    """On 132 SMs (4 programs each) with 8 KV heads, the Gluon TMA kernel's split count drops at the
    first batch whose 4-split programs overflow one wave; the step time jumps there, so the default
    grid has a decode count on each side of it (interpolating across it priced 17-24 sequences ~5% low)."""
    from kernels.decode_splits import splits_for
    grid = ProfileGrid.from_dict(yaml.safe_load((ROOT / "conf" / "profile_grid" / "default.yaml").read_text()))
    longest = round(max(grid.context_per_decode) / 2 * max(grid.context_ratios))  # a mid-grid longest context
    edge = next(d for d in range(1, 64) if splits_for((d + 1) * 8, longest, 4 * 132, 256, True)
                < splits_for(d * 8, longest, 4 * 132, 256, True))
    assert edge in grid.decode_seqs and edge + 1 in grid.decode_seqs
