"""Decode batches whose sequences share KV blocks (a cached system prompt, a forked prompt): the
batch shape counts the re-read entries from the block tables, and every latency model that prices
decode attention's KV reads prices them at `Hardware.kv_reread_cost` of a fresh read."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.request import Request, SamplingParams
from policies.sequence import Sequence
from sim.latency.base import BatchShape, shared_context_tokens
from sim.latency.profiled import ProfiledModel
from sim.latency.roofline import RooflineModel
from sim.latency.shapes import Hardware, ModelShape

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "experiments/profiles/h200-qwen3-0.6b.csv"
BS = 16


def _conf(group: str, name: str) -> dict:
    return yaml.safe_load((ROOT / f"conf/{group}/{name}.yaml").read_text())


def _seq(i: int, table: list[int], computed: int) -> Sequence:
    seq = Sequence.from_request(i, Request(f"r{i}", list(range(computed + 1)), SamplingParams(max_tokens=8)))
    seq.block_table = list(table)
    seq.num_computed_tokens = computed
    return seq


def _decodes(tables: list[list[int]]) -> SchedulerOutput:
    """A decode-only step: each sequence's table full up to its last block, one token to compute."""
    return SchedulerOutput(0.0, [ScheduledSeq(_seq(i, t, len(t) * BS - 1), 1, 1) for i, t in enumerate(tables)])


# Three sequences on one 4-block prefix (blocks 0-3), then private blocks; one with its own prefix.
SHARED = [[0, 1, 2, 3, 10, 11], [0, 1, 2, 3, 20], [0, 1, 2, 3, 30, 31, 32], [40, 41, 42]]
DISTINCT = [[100 + 10 * i + j for j in range(len(t))] for i, t in enumerate(SHARED)]


def test_shared_entries_are_every_block_an_earlier_table_holds():
    seqs = [s.seq for s in _decodes(SHARED).scheduled]
    assert shared_context_tokens(seqs, BS) == 2 * 4 * BS  # two tables re-read the 4 prefix blocks
    assert shared_context_tokens(seqs[:1] + seqs[3:], BS) == 0
    assert shared_context_tokens([s.seq for s in _decodes(DISTINCT).scheduled], BS) == 0
    # Two forks of one prompt (the whole table shared but the last block, copied on write).
    assert shared_context_tokens([_seq(0, [5, 6, 7], 47), _seq(1, [5, 6, 8], 47)], BS) == 2 * BS


def test_batch_shape_counts_shared_entries_of_decodes_only_when_asked():
    out = _decodes(SHARED)
    assert BatchShape.of(out).num_shared_context_tokens == 0  # not asked: no pass over the tables
    shape = BatchShape.of(out, block_size=BS)
    assert shape.num_shared_context_tokens == 2 * 4 * BS
    assert shape.kv_read_tokens(1.0) == shape.num_context_tokens
    assert shape.kv_read_tokens(0.25) == shape.num_context_tokens - 0.75 * 2 * 4 * BS
    # A prefill chunk over the same prefix reads it too, but it is not a decode: not counted.
    prefill = _seq(9, [0, 1, 2, 3, 50], 4 * BS)
    out.scheduled.append(ScheduledSeq(prefill, 10, 1))
    assert BatchShape.of(out, block_size=BS).num_shared_context_tokens == 2 * 4 * BS


def test_profiled_model_prices_shared_entries_at_the_reread_cost():
    fresh = ProfiledModel(PROFILE, BS)
    cheap = ProfiledModel(PROFILE, BS, kv_reread_cost=0.45)
    shared, distinct = _decodes(SHARED), _decodes(DISTINCT)
    assert fresh.step_time(shared) == fresh.step_time(distinct)  # cost 1: the blocks do not matter
    assert cheap.step_time(distinct) == fresh.step_time(distinct)
    shape = BatchShape.of(shared)
    expected = fresh.lookup(0, shape.num_decode_seqs, shape.num_context_tokens - 0.55 * 2 * 4 * BS)
    assert cheap.step_time(shared) == pytest.approx(expected, rel=1e-12)
    assert cheap.step_time(shared) < fresh.step_time(shared)
    # A fast-forwarded decode run carries the batch's shared entries to every step's price.
    times = cheap.decode_times(4, shape.num_context_tokens, 4, 3, num_shared_context_tokens=2 * 4 * BS)
    assert times[0] == pytest.approx(cheap.step_time(shared), rel=1e-12)
    assert times == sorted(times)


def test_roofline_prices_shared_bytes_at_l2_bandwidth():
    model = ModelShape.from_dict(_conf("model", "qwen3-0.6b"))
    hw = _conf("hardware", "h200")
    with_l2, without = Hardware.from_dict(hw), Hardware.from_dict({**hw, "l2_bandwidth": None})
    assert with_l2.kv_reread_cost == pytest.approx(hw["hbm_bandwidth"] / hw["l2_bandwidth"])
    assert without.kv_reread_cost == 1.0
    cheap, fresh = RooflineModel(model, with_l2, BS), RooflineModel(model, without, BS)
    shared, distinct = _decodes(SHARED), _decodes(DISTINCT)
    assert fresh.step_time(shared) == fresh.step_time(distinct)
    assert cheap.step_time(distinct) == fresh.step_time(distinct)
    saved = (1 - with_l2.kv_reread_cost) * 2 * 4 * BS * model.kv_bytes_per_token / (
        with_l2.hbm_bandwidth * with_l2.bandwidth_efficiency)
    assert fresh.step_time(shared) - cheap.step_time(shared) == pytest.approx(saved, rel=1e-9)


@pytest.mark.parametrize("value", [0.0, -1.0, "fast", True])
def test_bad_l2_bandwidth_is_named(value):
    with pytest.raises(ValueError, match="hardware.l2_bandwidth"):
        Hardware.from_dict({**_conf("hardware", "h200"), "l2_bandwidth": value})


@pytest.mark.parametrize("value", [-0.1, 1.5, "x", True])
def test_bad_reread_cost_is_named(value):
    with pytest.raises(ValueError, match="kv_reread_cost"):
        ProfiledModel(PROFILE, BS, kv_reread_cost=value)


def test_bench_shares_each_groups_prefix_and_solves_the_reread_cost():
    torch = pytest.importorskip("torch")
    from experiments.bench_shared_kv import reread_cost, share_prefix, shared_entries
    tables = torch.arange(24).view(4, 6)
    shared = share_prefix(tables, 2, 2)
    assert shared[:, :2].tolist() == [[0, 1], [6, 7], [0, 1], [6, 7]]
    assert torch.equal(shared[:, 2:], tables[:, 2:])
    assert shared_entries(4, 2 * BS, 2) == 2 * 2 * BS
    # 1 ms fixed + 1 us per entry; the shared entries at 0.4 of a fresh one.
    per_entry, fixed, batch, ctx, n = 1e-6, 1e-3, 4, 96, 2 * 2 * BS
    t = lambda entries: fixed + per_entry * entries
    cost = reread_cost(t(batch * ctx), t(batch * ctx - 0.6 * n), t(batch * (ctx + 32)), batch, 32, n)
    assert cost == pytest.approx(0.4)
    with pytest.raises(ValueError, match="groups=5"):
        share_prefix(tables, 2, 5)
    with pytest.raises(ValueError, match="no time per KV entry"):
        reread_cost(1.0, 0.9, 1.0, batch, 32, n)
