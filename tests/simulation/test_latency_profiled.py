"""Profiled latency model: schema, exact grid points, monotone interpolation, errors."""
import itertools
from pathlib import Path

import pytest
import yaml

from sim.latency import Hardware, ModelShape, ProfiledModel, RooflineModel
from sim.latency.base import BatchShape
from sim.latency.profile_io import read_profile, write_profile

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "experiments/profiles/example-synthetic.csv"


def test_example_profile_is_exact_at_grid_points():
    pm = ProfiledModel(EXAMPLE, block_size=16, model_name="qwen3-0.6b")
    _, rows = read_profile(EXAMPLE)
    steps = [r for _, r in rows if r["kind"] == "step"]
    assert len(steps) > 20
    for r in steps:
        p, d, c = int(r["num_prefill_tokens"]), int(r["num_decode_seqs"]), int(r["num_context_tokens"])
        assert pm.lookup(p, d, c) == pytest.approx(float(r["time_s"]), rel=1e-9)
    for _, r in rows:
        if r["kind"] == "swap":
            assert pm.swap_time(int(r["num_blocks"])) == pytest.approx(float(r["time_s"]), rel=1e-9)


def test_example_matches_the_roofline_it_was_generated_from():
    cfg = lambda group, name: yaml.safe_load((ROOT / f"conf/{group}/{name}.yaml").read_text())
    roof = RooflineModel(ModelShape.from_dict(cfg("model", "qwen3-0.6b")), Hardware.from_dict(cfg("hardware", "h200")), 16)
    pm = ProfiledModel(EXAMPLE, block_size=16)
    shape = BatchShape(num_decode_seqs=64, num_context_tokens=64 * 512, num_samples=64)
    assert pm.lookup(0, 64, 64 * 512) == pytest.approx(roof.shape_time(shape), rel=1e-7)  # 9 digits in the CSV


def test_interpolation_is_monotone_between_grid_points():
    pm = ProfiledModel(EXAMPLE, block_size=16)
    prefill = range(0, 2049, 97)
    decode = range(0, 257, 23)
    ctx = (100, 300, 700, 1500, 2500)
    for c in ctx:
        for p in prefill:
            times = [pm.lookup(p, d, d * c) for d in decode]
            assert times == sorted(times)
        for d in decode:
            times = [pm.lookup(p, d, d * c) for p in prefill]
            assert times == sorted(times)
    for p, d in itertools.product((0, 256), (1, 64)):
        times = [pm.lookup(p, d, d * c) for c in ctx]
        assert times == sorted(times)


def write(tmp_path, steps, swaps=((1, 1e-4), (10, 1e-3)), **meta):
    return write_profile(tmp_path / "p.csv", {"model": "m", "block_size": 16, **meta}, steps, swaps)


def test_multilinear_midpoints_and_linear_extrapolation(tmp_path):
    # t = 1 + p/100 + d/10 + d*ctx/1e4 on a 2x2x2 grid (the cross term is bilinear in d and ctx/seq)
    t = lambda p, d, c: 1 + p / 100 + d / 10 + c / 1e4
    steps = [(p, d, d * L, t(p, d, d * L)) for p in (0, 100) for d in (1, 3) for L in (10, 30)]
    pm = ProfiledModel(write(tmp_path, steps), block_size=16)
    assert pm.lookup(50, 2, 2 * 20) == pytest.approx(t(50, 2, 40))
    assert pm.lookup(200, 5, 5 * 40) == pytest.approx(t(200, 5, 200))  # outside: linear
    assert pm.swap_time(5) == pytest.approx(5e-4)
    assert pm.swap_time(20) == pytest.approx(2e-3)
    assert ProfiledModel(write(tmp_path, steps), block_size=32).swap_time(5) == pytest.approx(1e-3)


def test_missing_grid_point_is_named(tmp_path):
    steps = [(p, d, d * 10, 1.0) for p in (0, 64) for d in (1, 2)][:-1]
    with pytest.raises(ValueError, match=r"lacks the grid point num_prefill_tokens=64, num_decode_seqs=2"):
        ProfiledModel(write(tmp_path, steps), block_size=16)


def test_bad_rows_name_file_line_and_field(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("# model: m\nkind,num_prefill_tokens,num_decode_seqs,num_context_tokens,num_blocks,time_s\n"
                    "step,0,1,10,,0.001\nstep,0,x,10,,0.001\n")
    with pytest.raises(ValueError, match=r"bad.csv:4: field num_decode_seqs='x' is invalid"):
        ProfiledModel(path, block_size=16)
    path.write_text("kind,num_prefill_tokens,time_s\nstep,0,1\n")
    with pytest.raises(ValueError, match=r"header lacks columns"):
        ProfiledModel(path, block_size=16)


def test_model_mismatch_and_missing_swaps(tmp_path):
    steps = [(0, 1, 10, 1e-3)]
    with pytest.raises(ValueError, match=r"measured for model='m', not model='other'"):
        ProfiledModel(write(tmp_path, steps), block_size=16, model_name="other")
    with pytest.raises(ValueError, match=r"no kind=swap rows"):
        ProfiledModel(write(tmp_path, steps, swaps=()), block_size=16)


def test_profile_mode_must_match_the_runs_scheduler_mode(tmp_path):
    steps, swaps = [(0, 0, 0, 1e-3), (0, 1, 16, 2e-3)], [(1, 1e-4)]
    sync = write_profile(tmp_path / "sync.csv", {"model": "m", "block_size": 16}, steps, swaps)
    ahead = write_profile(tmp_path / "ahead.csv", {"model": "m", "block_size": 16, "async_scheduling": "true"},
                          steps, swaps)
    ProfiledModel(sync, 16, "m", async_scheduling=False)
    ProfiledModel(ahead, 16, "m", async_scheduling=True)
    with pytest.raises(ValueError, match="scheduler.async_scheduling=True is invalid with latency profile"):
        ProfiledModel(sync, 16, "m", async_scheduling=True)
    with pytest.raises(ValueError, match="measured with async_scheduling=True"):
        ProfiledModel(ahead, 16, "m", async_scheduling=False)


def _out(p: int, d: int, ahead: bool):
    from policies import Request, SamplingParams
    from policies.outputs import ScheduledSeq, SchedulerOutput
    from policies.sequence import Sequence
    out = SchedulerOutput(0.0, ahead=ahead)
    if p:
        out.scheduled.append(ScheduledSeq(Sequence.from_request(0, Request("p", [1] * p, SamplingParams())), p, 1))
    for i in range(d):
        seq = Sequence.from_request(i + 1, Request(f"d{i}", [1] * 16, SamplingParams()))
        seq.num_computed_tokens = 15
        out.scheduled.append(ScheduledSeq(seq, 1, 1))
    return out


def test_steps_scheduled_ahead_use_time_s_and_the_others_sync_time_s(tmp_path):
    from experiments.lib.profiling.grid import write_profile as write_rows
    rows = [{"kind": "step", "num_prefill_tokens": p, "num_decode_seqs": d, "num_context_tokens": 16 * d,
             "time_s": 1e-3 * (1 + p / 100 + d), "sync_time_s": 1e-3 * (1.5 + p / 100 + d)}
            for p in (0, 100) for d in (0, 1, 4)]
    rows += [{"kind": "swap", "num_blocks": 1, "time_s": 1e-4}]
    path = write_rows(tmp_path / "p.csv", {"model": "m", "block_size": 16, "async_scheduling": "true"}, rows)
    model = ProfiledModel(path, 16, "m", async_scheduling=True)
    assert model.step_time(_out(100, 4, ahead=True)) == pytest.approx(6e-3)
    assert model.step_time(_out(100, 4, ahead=False)) == pytest.approx(6.5e-3)
    assert model.step_time(_out(0, 1, ahead=False)) == pytest.approx(2.5e-3)


def test_prefill_rows_are_priced_at_the_step_s_own_graph_padding(tmp_path):
    """A row (P, D) ran the graph of the smallest token size >= P + D; the model takes that padding
    out and adds the priced step's own, at the per-token cost of the prefill-only rows."""
    from experiments.lib.profiling.grid import write_profile as write_rows
    sizes = [64, 128, 256, 512]
    cost = lambda t: 1e-3 + 2e-6 * next((s for s in sizes if s >= t), t)  # linear in the padded tokens
    rows = [{"kind": "step", "num_prefill_tokens": p, "num_decode_seqs": d, "num_context_tokens": 16 * d,
             "time_s": cost(p + d) if p else 1e-3 + 1e-5 * d} for p in (0, 128, 256, 512) for d in (0, 1, 8)]
    rows += [{"kind": "swap", "num_blocks": 1, "time_s": 1e-4}]
    meta = {"model": "m", "block_size": 16, "token_graph_sizes": " ".join(map(str, sizes))}
    model = ProfiledModel(write_rows(tmp_path / "p.csv", meta, rows), 16, "m")
    assert model.pad_token_s == pytest.approx(2e-6)
    for p, d in ((128, 1), (200, 8), (300, 1), (250, 6), (512, 0)):
        assert model.step_time(_out(p, d, ahead=False)) == pytest.approx(cost(p + d)), (p, d)
    plain = ProfiledModel(write_rows(tmp_path / "q.csv", {"model": "m", "block_size": 16}, rows), 16, "m")
    assert plain.step_time(_out(250, 6, ahead=False)) != pytest.approx(cost(256))  # without the sizes


@pytest.mark.parametrize("p, d, context", [(82, 15, 15 * 900), (20, 8, 8 * 300), (100, 16, 16 * 1500)])
def test_a_small_mixed_step_is_priced_from_its_bracketing_rows(p, d, context):
    """A step with a few prefill tokens beside at most 16 decodes (the priority scenarios' mixed
    steps) on the packed profile: the multilinear mean of the 8 rows around it, each with its own
    CUDA-graph padding taken out, plus the step's own padding; so within those rows' range."""
    from sim.latency.token_padding import padded
    path = ROOT / "experiments/profiles/h200-qwen3-0.6b-async-packed.csv"
    pm = ProfiledModel(path, 16, "qwen3-0.6b", async_scheduling=True)
    meta, rows = read_profile(path)
    sizes = [int(s) for s in meta["token_graph_sizes"].split()]
    table = {(int(r["num_prefill_tokens"]), int(r["num_decode_seqs"]), int(r["num_context_tokens"])):
             float(r["time_s"]) for _, r in rows if r["kind"] == "step"}

    def around(x, axis):
        lo = max(v for v in axis if v <= x)
        hi = min(v for v in axis if v > x)
        return ((lo, (hi - x) / (hi - lo)), (hi, (x - lo) / (hi - lo)))

    ctx_axis = sorted({c // k for k_p, k, c in table if k_p == 2 and k == 8})
    expected, corners = 0.0, []
    for (pp, wp), (dd, wd), (cc, wc) in itertools.product(
            around(p, sorted({k[0] for k in table})), around(d, sorted({k[1] for k in table})),
            around(context / d, ctx_axis)):
        t = table[(pp, dd, dd * cc)]
        corners.append(t)
        expected += wp * wd * wc * (t - pm.pad_token_s * (padded(pp + dd, sizes) - pp - dd))
    expected += pm.pad_token_s * (padded(p + d, sizes) - p - d)
    shape = BatchShape(p, 1, 0, p * (p + 1) // 2, d, context, d + 1, 0, ((p, 0),))
    assert pm.shape_time(shape) == pytest.approx(expected, rel=1e-9)
    assert min(corners) * 0.95 <= pm.shape_time(shape) <= max(corners) * 1.05
