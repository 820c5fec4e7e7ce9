"""The bound on what a workload's prompts hold in memory (common.PromptMemory): 8 bytes a prompt
token and 32 more for each token id drawn afresh, so prompts that share ids (Mooncake blocks, system
prompts, a session's earlier turns) take less of it than prompts of fresh ids; past the bound, one
ValueError naming the setting or the trace's row, the estimate, the bound and what to lower, raised
before any token id is drawn."""
from __future__ import annotations

import json
import re
import tracemalloc

import pytest
from test_workload_bad_input import NANOVLLM, POISSON, SESSIONS, build, raises
from workload_helpers import trace_workload

from experiments import make_mooncake_trace as mk
from experiments.lib.workloads import common

BOUND = 4000  # bytes: 100 prompt tokens of fresh ids
LARGE = 100_000  # a vocabulary


@pytest.fixture
def small_bound(monkeypatch):
    monkeypatch.setattr(common, "MAX_PROMPT_BYTES", BOUND)


class Drawn(Exception):
    """Raised in place of numpy's default_rng: every row was checked and within the bound."""


def no_draws(monkeypatch):
    def refuse(*args, **kwargs):
        raise Drawn
    monkeypatch.setattr("numpy.random.default_rng", refuse)


def over(tokens: int, drawn: int) -> str:
    size = 8 * tokens + 32 * drawn
    assert size > BOUND
    return (rf"the prompts would hold about {size:,} bytes of token ids \({tokens:,} prompt tokens at 8 bytes and "
            rf"{drawn:,} token ids drawn afresh at 32\), more than the {BOUND:,} bytes a workload may hold")


@pytest.mark.parametrize(("cfg", "match"), [
    ({**POISSON, "num_requests": 20}, rf"^workload\.prompt_len: {over(160, 160)}: lower workload\.num_requests"),
    ({**POISSON, "num_requests": 10, "system_prompts": {"num": 1, "len": 30}},
     rf"^workload\.prompt_len: {over(380, 110)}"),  # 10 x (8 + 30) tokens; 10 x 8 + 30 ids: the system prompt's once
    ({**POISSON, "num_requests": 13, "shared_prefix_len": 4}, rf"^workload\.prompt_len: {over(104, 108)}"),
    ({**POISSON, "system_prompts": {"num": 20, "len": 6}},
     rf"^workload\.system_prompts=\{{num: 20, len: 6\}}: {over(120, 120)}: use fewer or shorter ones"),
    ({**POISSON, "tenants": {"names": ["a", "b"], "rates": [1.0, 1.0], "num_requests": [10, 10]}},
     rf"^workload\.prompt_len: {over(160, 160)}"),  # each tenant's 3,200 bytes under the bound, both over it
    ({**SESSIONS, "num_sessions": 4, "turns": {"dist": "fixed", "value": 3}},  # prompts of 8 + 20 + 32 tokens each,
     rf"^workload\.num_sessions=4: {over(240, 144)}: lower it, the turns or workload\.max_prompt_len"),  # 3 x (8 + 4) ids
    ({**NANOVLLM, "num_requests": 2}, rf"^workload\.num_requests=2 x workload\.max_input_len=100 \(the longest the "
                                      rf"prompts may be\): {over(200, 200)}: lower one of them"),
])
def test_a_workload_whose_prompts_are_past_the_bound_is_refused(cfg, match, small_bound):
    with raises(match):
        build(cfg)


MOONCAKE_ROW = '{{"timestamp": 0, "input_length": {n}, "output_length": 2, "hash_ids": [{k}]}}'


@pytest.mark.parametrize(("kind", "name", "header", "row"), [
    ("replay", "t.jsonl", "", '{{"arrival_time": 0, "prompt_len": {n}, "output_len": 2}}'),
    ("replay", "t.jsonl", "", '{{"arrival_time": 0, "prompt_token_ids": {ids}, "output_len": 2}}'),
    ("replay", "t.csv", "arrival_time,prompt_token_ids,output_len", "0,{words},2"),
    ("azure", "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46,{n},10"),
    ("burstgpt", "t.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type", "5,ChatGPT,{n},3,0,x"),
    ("mooncake", "t.jsonl", "", MOONCAKE_ROW),  # a block of its own each
])
def test_a_trace_past_the_bound_names_the_row_before_any_id_is_drawn(kind, name, header, row, small_bound,
                                                                      monkeypatch, tmp_path):
    no_draws(monkeypatch)
    ids = list(range(100, 140))
    rows = [row.format(n=40, ids=ids, words=" ".join(map(str, ids)), k=k) for k in range(4)]
    text = "\n".join([header, *rows] if header else rows) + "\n"
    line = 4 if header else 3  # the third row: 120 tokens of fresh ids, 4,800 bytes
    fix = r"set workload\.num_requests to replay fewer rows"
    with raises(rf"^{re.escape(str(tmp_path / name))}:{line}: {over(120, 120)}: {fix}"):
        trace_workload(tmp_path, name, text, kind=kind)


def test_mooncake_prompts_of_shared_blocks_count_their_blocks_ids_once(small_bound, monkeypatch, tmp_path):
    """Four prompts of one block's 40 tokens: 160 tokens at 8 bytes, 40 ids at 32 (2,560 bytes),
    within a bound that four blocks of their own (6,400 bytes) go past at the third row."""
    text = "".join(MOONCAKE_ROW.format(n=40, k=1) + "\n" for _ in range(4))
    w = trace_workload(tmp_path, "t.jsonl", text, kind="mooncake")
    assert len({id(r.prompt_token_ids[0]) for r in w.requests}) == 1  # the same int objects
    with raises(rf":3: {over(120, 120)}: set workload\.num_requests to replay fewer rows \(or make a trace of fewer "
                r"--hours with experiments\.make_mooncake_trace\)$"):
        trace_workload(tmp_path, "t.jsonl", "".join(MOONCAKE_ROW.format(n=40, k=k) + "\n" for k in range(4)),
                       kind="mooncake")


def test_a_mooncake_block_read_further_than_before_counts_its_new_draw(monkeypatch, tmp_path):
    """Block 7 is drawn to 3 ids, then anew to 4 (the first prompt keeps its 3); block 8 to 2, then
    read to 1: 10 prompt tokens, 9 ids drawn."""
    monkeypatch.setattr(common, "MAX_PROMPT_BYTES", 8 * 9 + 32 * 9)  # the first two rows exactly
    rows = [(3, [7]), (6, [7, 8]), (1, [8])]
    text = "".join(json.dumps({"timestamp": 0, "input_length": n, "output_length": 2, "hash_ids": ids}) + "\n"
                   for n, ids in rows)
    with raises(r":3: the prompts would hold about 368 bytes of token ids \(10 prompt tokens at 8 bytes and 9 token "
                r"ids drawn afresh"):
        trace_workload(tmp_path, "t.jsonl", text, kind="mooncake", block_tokens=4)


@pytest.mark.parametrize("cfg", [
    {**POISSON, "num_requests": 400, "prompt_len": {"dist": "uniform", "low": 500, "high": 1500},
     "system_prompts": {"num": 4, "len": 300}, "vocab_size": LARGE},
    {**SESSIONS, "num_sessions": 40, "turns": {"dist": "fixed", "value": 6}, "vocab_size": LARGE,
     "prompt_len": {"dist": "fixed", "value": 200}, "output_len": {"dist": "fixed", "value": 100}},
    "mooncake",
], ids=["synthetic", "sessions", "mooncake"])
def test_the_estimate_is_the_memory_the_prompts_take(cfg, monkeypatch, tmp_path):
    """Within 15% of what tracemalloc counts the built workload holding (its requests take the rest;
    ids are drawn from a large vocabulary, as a model's are, so few are Python's cached small ints)."""
    sizes = []
    add = common.PromptMemory.add

    def spy(self, *args):
        out = add(self, *args)
        sizes.append(self.size)
        return out
    monkeypatch.setattr(common.PromptMemory, "add", spy)
    if cfg == "mooncake":
        path = tmp_path / "m.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in mk.make_trace(mk.MooncakeTraceSpec(hours=0.01))))
        cfg = {"kind": "mooncake", "path": str(path)}
    tracemalloc.start()
    try:
        w = build(cfg, vocab_size=LARGE)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(w) and 1.0 <= held / max(sizes) < 1.15  # the largest: the workload's, not its system prompts'


def test_a_two_hour_mooncake_style_trace_is_within_the_bound(monkeypatch, tmp_path):
    """358M prompt tokens, half their blocks repeated: about 8 GiB of token ids."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in mk.make_trace(mk.MooncakeTraceSpec(hours=2))))
    no_draws(monkeypatch)
    with pytest.raises(Drawn):  # every row was within the bound
        build({"kind": "mooncake", "path": str(path)})
