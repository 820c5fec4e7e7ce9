"""The prefill kernel's program packing (sim/latency/prefill_schedule.py), its fit in the profiler
and its use by the profiled latency model."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples

from experiments.lib.profiling.grid import fit_prefill_tile_s
from experiments.lib.profiling.synthetic import StepShape, split_tokens, synthetic_step
from sim.latency import ProfiledModel
from sim.latency.base import BatchShape
from sim.latency.prefill_schedule import PrefillSchedule
from tests.runs.test_profile import _synthetic_file

H200 = PrefillSchedule(tokens_per_tile=64, keys_per_tile=128, programs_per_tile=8, concurrent=132)


def test_parse_format_round_trip_and_errors():
    assert PrefillSchedule.parse(H200.format()) == H200
    assert PrefillSchedule.parse("concurrent=4, keys_per_tile=2 tokens_per_tile=1 programs_per_tile=3") == \
        PrefillSchedule(1, 2, 3, 4)
    for text, match in (("tokens_per_tile=64 keys_per_tile=128 programs_per_tile=8", "lacks concurrent"),
                        ("tokens_per_tile=x keys_per_tile=1 programs_per_tile=1 concurrent=1", "'x' is not an integer"),
                        ("tile=64", "got 'tile=64'"),
                        ("tokens_per_tile=0 keys_per_tile=1 programs_per_tile=1 concurrent=1", "tokens_per_tile=0")):
        with pytest.raises(ValueError, match=match):
            PrefillSchedule.parse(text)


def test_makespan_by_hand():
    # 1792 tokens, one prompt: 28 query tiles of 1..14 key tiles, x8 programs = 224 programs on 132 slots;
    # heaviest first, the 14-tile programs run alone on 8 slots and set the makespan.
    assert H200.single(1792) == 14
    assert H200.single(1024) == 8  # 128 programs: one each, the last tile's 8 key tiles
    assert H200.single(0) == 0
    # four 448-token prompts: 7 tiles each of 1,1,2,2,3,3,4 key tiles -> 224 programs of total load
    # 8 * 4 * 16 = 512 on 132 slots, heaviest first: >= ceil(512 / 132) = 4, and 4 is reachable.
    assert H200.makespan(((448, 0),) * 4) == 4
    # A chunk over a 1000-token prefix: each program also reads the prefix.
    assert H200.makespan(((64, 1000),)) == math.ceil(1064 / 128)
    tiny = PrefillSchedule(1, 1, 1, 2)  # one-token tiles, one key per tile, 2 slots: LPT of 1..5
    assert tiny.makespan(((5, 0),)) == 8  # 5+3 / 4+2+1 -> 8


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.integers(2, 600), st.integers(0, 3000)), min_size=1, max_size=8),
       st.integers(1, 200))
def test_makespan_bounds(chunks, concurrent):
    s = PrefillSchedule(64, 128, 8, concurrent)
    costs = [math.ceil((c + min(a + 64, q)) / 128) for q, c in chunks for a in range(0, q, 64)] * 8
    m = s.makespan(tuple(chunks))
    assert max(costs) <= m <= sum(costs)
    assert m >= math.ceil(sum(costs) / concurrent)
    assert m <= sum(costs) / concurrent + max(costs)  # list scheduling's bound
    assert s.makespan(tuple(reversed(chunks))) == m  # order of the chunks is irrelevant


def test_fit_recovers_the_seconds_per_tile():
    k, base = 1e-4, {1024: 4e-3, 1536: 6e-3}
    points = [(p, n, base[p] + k * (H200.makespan(tuple((q, 0) for q in split_tokens(p, n))) - H200.single(p)))
              for p in base for n in (1, 2, 4, 8)]
    points = [(p, n, t + k * H200.single(p)) for p, n, t in points]  # one-sequence rows carry their own cost
    used, slope, se = fit_prefill_tile_s(points, H200)
    assert used == slope == pytest.approx(k, rel=1e-9) and se < 1e-12
    assert fit_prefill_tile_s([(1024, 1, 1.0)], H200) == (0.0, 0.0, math.inf)  # no split rows
    flat = [(p, n, 5e-3 + (1e-4 if n == 2 else -1e-4 if n == 4 else 0.0)) for p in base for n in (1, 2, 4, 8)]
    assert fit_prefill_tile_s(flat, H200)[0] == 0.0  # no significant slope: not used


def test_profiled_model_prices_layouts_by_makespan(tmp_path):
    fn = lambda p, d, c: 1e-3 + 1e-6 * p + 1e-5 * d + 1e-9 * d * c
    meta = {"prefill_pair_s": "1e-9", "prefill_schedule": H200.format(), "prefill_tile_s": "1e-4"}
    model = ProfiledModel(_synthetic_file(tmp_path, fn, meta), block_size=16)
    one = synthetic_step(StepShape(512, 1, 0, 0), 16, 1000, 256)
    four = synthetic_step(StepShape(512, 4, 0, 0), 16, 1000, 256)
    assert BatchShape.of(four).prefill_chunks == ((128, 0),) * 4
    assert model.step_time(one) == pytest.approx(model.lookup(512, 0, 0))  # the grid's own layout: exact
    expected = model.lookup(512, 0, 0) + 1e-4 * (H200.makespan(((128, 0),) * 4) - H200.single(512))
    assert model.step_time(four) == pytest.approx(expected) and model.step_time(four) < model.step_time(one)
    for bad, match in (({**meta, "prefill_schedule": "tokens_per_tile=64"}, "p.csv: metadata prefill schedule"),
                       ({**meta, "prefill_tile_s": "-2"}, "prefill_tile_s")):
        with pytest.raises(ValueError, match=match):
            ProfiledModel(_synthetic_file(tmp_path, fn, bad), block_size=16)
