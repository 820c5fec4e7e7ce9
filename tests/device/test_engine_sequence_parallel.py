"""Sequence-parallel steps in whole tensor-parallel engines on CPU (gloo): with
`sequence_parallel_min_rows` low, every step of that many tokens runs sequence-parallel on every
rank (the others keep the all-reduces), and the greedy tokens equal the single-process engine's, as
tests/device/test_engine_tp.py asserts for the all-reduce path: Qwen3 (dummy weights and a
checkpoint), Qwen2 (the q/k/v bias) and Llama, at 2 and 4 ranks, through chunked prefill, swap
preemption and async scheduling. Padded steps' hidden states and logits against the all-reduce
path's: tests/device/test_sequence_parallel.py."""
from __future__ import annotations

import pytest
from test_engine_tp import SCENARIOS, checkpoints, one_engine_at_a_time, reference, run  # noqa: F401 (fixtures)

from engine.models import llama

# Prefill steps (tens of tokens) and decode steps of 3+ sequences take the path; the decode steps
# of the last one or two sequences keep the all-reduces: both within one engine.
MIN_ROWS = 3


@pytest.fixture(scope="module")
def sp_engines(checkpoints):  # noqa: F811 (the imported fixture)
    """(model, N) -> a sequence-parallel engine; one open at a time (one group per process)."""
    yield from one_engine_at_a_time(checkpoints, sequence_parallel_min_rows=MIN_ROWS)


def counting_sequence_parallel(monkeypatch) -> list[int]:
    """The row counts of rank 0's sequence-parallel forwards from here on (the workers' are theirs)."""
    rows, forward = [], llama.sequence_parallel_forward

    def counted(model, input_ids, positions, meta):
        rows.append(input_ids.shape[0])
        return forward(model, input_ids, positions, meta)

    monkeypatch.setattr(llama, "sequence_parallel_forward", counted)
    return rows


def default_choices(monkeypatch, taken: list[int]) -> list[tuple[int, bool]]:
    """(rows, took the path) of rank 0's forwards that chose by themselves (`sequence_parallel`
    None: eager steps; graph captures and replays pass False), `taken` being
    `counting_sequence_parallel`'s list."""
    choices, forward = [], llama.ShardedLlamaForCausalLM.forward

    def chosen(model, input_ids, positions, meta, sequence_parallel=None):
        before = len(taken)
        out = forward(model, input_ids, positions, meta, sequence_parallel)
        if sequence_parallel is None:
            choices.append((input_ids.shape[0], len(taken) > before))
        return out

    monkeypatch.setattr(llama.ShardedLlamaForCausalLM, "forward", chosen)
    return choices


CASES = [("tiny-qwen3", 2, s) for s in ("plain", "chunked")] + [("qwen3", 2, "async")] \
    + [("qwen2", 2, s) for s in ("plain", "swap")] + [("llama", 4, s) for s in ("plain", "chunked")] \
    + [("qwen3", 4, "plain")]


@pytest.mark.parametrize(("model", "size", "scenario"), CASES, ids=[f"{m}-tp{n}-{s}" for m, n, s in CASES])
def test_sequence_parallel_engine_matches_single_process(sp_engines, reference, model, size, scenario,  # noqa: F811
                                                         monkeypatch):
    engine = sp_engines(model, size)
    rows = counting_sequence_parallel(monkeypatch)
    choices = default_choices(monkeypatch, rows)
    got, want = run(engine, scenario), reference(model, scenario)
    assert rows and min(rows) >= MIN_ROWS  # steps of 3+ tokens took the path, no smaller one did
    assert any(took for _, took in choices), choices  # forwards chose by themselves
    assert all(took == (n >= MIN_ROWS) for n, took in choices), choices  # and every such step did
    assert got["tokens"] == want["tokens"]
    assert got["finish"] == want["finish"]
    if SCENARIOS[scenario].get("mode") == "swap":
        assert got["swapped"] > 0
