"""Bad workload input: each is one ValueError naming the setting or the trace file and line, the
value and what is allowed, raised before anything large is built (the CLI prints it as one line,
tests/runs/test_bad_input_run.py)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from workload_helpers import VOCAB, trace_workload

from experiments.lib.workloads import build_workload


def raises(match: str):
    return pytest.raises(ValueError, match=match)


# ---- text that is not UTF-8 ---------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "name", "data"), [
    ("replay", "t.jsonl", b'{"arrival_time": 0, "prompt_len": 4, "output_len": 2}\n{"a\xff": 1}\n'),
    ("replay", "t.csv", b"arrival_time,prompt_len,output_len\n0,4,2\n0,\xff,2\n"),
    ("azure", "t.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff\n"),
    ("burstgpt", "t.csv", b"\xffTimestamp\n"),
    ("mooncake", "t.jsonl", b'{"timestamp": 0}\xfe\n'),
])
def test_a_trace_that_is_not_utf8_names_the_file_line_and_byte(kind, name, data, tmp_path):
    line = data[:data.index(b"\xff") if b"\xff" in data else data.index(b"\xfe")].count(b"\n") + 1
    with raises(rf"{re.escape(str(tmp_path / name))}:{line}: not UTF-8 text \(byte 0x(ff|fe) at position \d+\)"):
        trace_workload(tmp_path, name, data, kind=kind)


# ---- bounds: a length, a count (the prompts' memory: test_workload_prompt_memory.py) ------------
HUGE = 10**12
POISSON = {"kind": "synthetic", "num_requests": 4, "arrival": "poisson", "rate": 10.0,
           "prompt_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed", "value": 4}, "vocab_size": VOCAB}
SESSIONS = {"kind": "sessions", "num_sessions": 3, "rate": 1.0, "turns": {"dist": "fixed", "value": 2},
            "prompt_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed", "value": 4}, "vocab_size": VOCAB}
NANOVLLM = {"kind": "nanovllm", "num_requests": 2, "max_input_len": 100, "max_output_len": 100}
MOONCAKE = {"kind": "mooncake", "path": "experiments/lib/workloads/fixtures/mooncake.jsonl"}
LENGTH_BOUND = r"must be at most 10,000,000 \(tokens; a longer prompt or output fits no model's context\)"
COUNT_BOUND = r"must be at most 10,000,000 \(the most a workload may hold\)"


def build(cfg, vocab_size=151936):
    return build_workload(cfg, seed=0, vocab_size=vocab_size)


@pytest.mark.parametrize(("cfg", "match"), [
    ({**POISSON, "prompt_len": {"dist": "fixed", "value": HUGE}}, rf"^workload\.prompt_len\.value={HUGE} is invalid: {LENGTH_BOUND}"),
    ({**POISSON, "output_len": {"dist": "uniform", "low": 1, "high": HUGE}}, rf"^workload\.output_len\.high={HUGE} is invalid: {LENGTH_BOUND}"),
    ({**POISSON, "prompt_len": {"dist": "lognormal", "mean": 9, "sigma": 1, "min": 1, "max": HUGE}},
     rf"^workload\.prompt_len\.max={HUGE} is invalid: {LENGTH_BOUND}"),
    ({**POISSON, "num_requests": HUGE}, rf"^workload\.num_requests={HUGE} is invalid: {COUNT_BOUND}"),
    ({**POISSON, "max_tokens": HUGE}, rf"^workload\.max_tokens={HUGE} is invalid: {LENGTH_BOUND}"),
    ({**POISSON, "shared_prefix_len": HUGE}, rf"^workload\.shared_prefix_len={HUGE} is invalid: {LENGTH_BOUND}"),
    ({**POISSON, "system_prompts": {"num": 2, "len": HUGE}}, rf"^workload\.system_prompts\.len={HUGE} is invalid"),
    ({**POISSON, "system_prompts": {"num": HUGE, "len": 2}}, rf"^workload\.system_prompts\.num={HUGE} is invalid"),
    ({**POISSON, "tenants": {"names": ["a", "b"], "rates": [1.0, 1.0], "num_requests": [HUGE, 1]}},
     r"^workload\.tenants\.num_requests=\[1000000000000, 1\] is invalid: need 2 integers >= 1 with a sum of at most 10,000,000"),
    ({**SESSIONS, "num_sessions": HUGE}, rf"^workload\.num_sessions={HUGE} is invalid: {COUNT_BOUND}"),
    ({**SESSIONS, "turns": {"dist": "fixed", "value": HUGE}}, rf"^workload\.turns\.value={HUGE} is invalid: {COUNT_BOUND}"),
    ({**SESSIONS, "num_sessions": 3_000_000, "turns": {"dist": "fixed", "value": 4}},
     r"^workload\.turns: the 3,000,000 sessions' turns come to 12,000,000 requests, more than the 10,000,000"),
    ({**NANOVLLM, "max_input_len": HUGE}, rf"^workload\.max_input_len={HUGE} is invalid: {LENGTH_BOUND}"),
    ({**NANOVLLM, "num_requests": HUGE}, rf"^workload\.num_requests={HUGE} is invalid: {COUNT_BOUND}"),
    ({**MOONCAKE, "block_tokens": HUGE}, rf"^workload\.block_tokens={HUGE} is invalid: {LENGTH_BOUND}"),
    ({**MOONCAKE, "num_requests": HUGE}, rf"^workload\.num_requests={HUGE} is invalid: {COUNT_BOUND}"),
])
def test_a_setting_past_its_bound_is_refused_before_anything_is_drawn(cfg, match):
    with raises(match):
        build(cfg)


ROW = '{"arrival_time": 0, "prompt_len": 4, "output_len": 2}\n'


@pytest.mark.parametrize(("kind", "name", "text", "match"), [
    ("replay", "t.jsonl", ROW + f'{{"arrival_time": 0, "prompt_len": {HUGE}, "output_len": 2}}\n',
     rf":2: field prompt_len={HUGE} is invalid: {LENGTH_BOUND}"),
    ("replay", "t.jsonl", ROW + f'{{"arrival_time": 0, "prompt_len": 4, "output_len": {HUGE}}}\n',
     rf":2: field output_len={HUGE} is invalid: {LENGTH_BOUND}"),
    ("replay", "t.csv", f"arrival_time,prompt_len,output_len,max_tokens\n0,4,2,{HUGE}\n",
     rf":2: field max_tokens='{HUGE}' is invalid: {LENGTH_BOUND}"),
    ("azure", "t.csv", f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,{HUGE},10\n",
     rf":2: field ContextTokens='{HUGE}' is invalid: {LENGTH_BOUND}"),
    ("burstgpt", "t.csv", f"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,ChatGPT,4,{HUGE},0,x\n",
     rf":2: field Response tokens='{HUGE}' is invalid: {LENGTH_BOUND}"),
    ("mooncake", "t.jsonl", f'{{"timestamp": 0, "input_length": {HUGE}, "output_length": 2, "hash_ids": [1]}}\n',
     rf":1: field input_length={HUGE} is invalid: {LENGTH_BOUND}"),
])
def test_a_trace_length_past_the_bound_names_file_line_and_field(kind, name, text, match, tmp_path):
    with raises(re.escape(str(tmp_path / name)) + match):
        trace_workload(tmp_path, name, text, kind=kind)


def test_given_prompt_ids_past_the_bound_are_refused(tmp_path, monkeypatch):
    from experiments.lib.workloads import replay
    monkeypatch.setattr(replay, "MAX_LENGTH", 3)
    with raises(r"t.jsonl:1: field prompt_token_ids='<4 ids>' is invalid: must hold at most 3 ids"):
        trace_workload(tmp_path, "t.jsonl",
                       '{"arrival_time": 0, "prompt_token_ids": [1, 2, 3, 4], "output_len": 2}\n')


def test_a_trace_of_more_rows_than_the_bound_is_refused_unless_cut(tmp_path, monkeypatch):
    from experiments.lib.workloads import replay
    monkeypatch.setattr(replay, "MAX_REQUESTS", 2)
    text = ROW * 3 + "not json: never read when num_requests cuts the trace before it\n"
    with raises(r"workload\.path='.*t\.jsonl' holds more than 2 requests, the most a workload may hold: set "
                r"workload\.num_requests to replay its first rows"):
        trace_workload(tmp_path, "t.jsonl", text)
    assert len(trace_workload(tmp_path, "t.jsonl", text, num_requests=2)) == 2


def test_mooncake_blocks_are_drawn_as_far_as_read_with_the_same_ids(tmp_path):
    """A block first read in part is drawn in part; the ids are those of its whole draw either way."""
    rows = [(3, [7]), (6, [7, 8]), (1, [8])]  # block 7 read in part, then whole; block 8 in part, twice
    text = "".join(f'{{"timestamp": {k}, "input_length": {n}, "output_length": 2, "hash_ids": {ids}}}\n'
                   for k, (n, ids) in enumerate(rows))
    w = trace_workload(tmp_path, "t.jsonl", text, kind="mooncake", block_tokens=4, seed=5)
    whole = {h: np.random.default_rng([5, h]).integers(0, VOCAB, size=4).tolist() for h in (7, 8)}
    assert [r.prompt_token_ids for r in w.requests] == [whole[7][:3], whole[7] + whole[8][:2], whole[8][:1]]


def test_a_long_legal_prompt_is_aborted_too_long_while_the_others_finish(tmp_path):
    """A prompt within the bound but past the run's max_model_len is the scheduler's to refuse
    (abort:too_long), not the workload's: the run goes on."""
    import pandas as pd

    from experiments.lib.fidelity_spec import compose_cfg
    from experiments.lib.run_workload import run

    rows = [{"request_id": "a", "arrival_time": 0.0, "prompt_len": 8, "output_len": 3},
            {"request_id": "long", "arrival_time": 0.01, "prompt_len": 100_000, "output_len": 3},
            {"request_id": "c", "arrival_time": 0.02, "prompt_len": 8, "output_len": 3}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run(compose_cfg(["workload=replay", f"workload.path={path}", "model=qwen3-0.6b",
                               "scheduler.max_model_len=40960", "blocks.kv_cache_gib=5", "progress=false",
                               "plots=false"]), tmp_path / "out")
    req = pd.read_parquet(tmp_path / "out" / "requests.parquet").set_index("request_id")
    assert req.loc["long", "finish_reason"] == "abort:too_long"
    assert summary["completed"] == 2 and summary["abort_reasons"] == {"abort:too_long": 1}


# ---- replay: only its own fields, one prompt length -------------------------------------------------
ALLOWED = re.escape("allowed are ['request_id', 'arrival_time', 'prompt_token_ids', 'prompt_len', 'output_len', "
                    "'max_tokens', 'priority', 'tenant']")


@pytest.mark.parametrize(("name", "text", "match"), [
    ("t.jsonl", ROW + '{"arrival_time": 0, "prompt_len": 4, "output_len": 2, "priorty": 1}\n',
     rf":2: field 'priorty' is unknown: {ALLOWED}"),
    ("t.jsonl", '{"arrival_time": 0, "prompt_len": 4, "output_len": 2, "max_token": 9}\n',
     rf":1: field 'max_token' is unknown: {ALLOWED}"),
    ("t.jsonl", '\n{"arrival_time": 0, "prompt_len": 4, "output_len": 2, "sampling": {"temperature": 0}}\n',
     rf":2: field 'sampling' is unknown: {ALLOWED}"),
    ("t.csv", "arrival_time,prompt_len,output_len,prio\n0,4,2,1\n", rf":1: field 'prio' is unknown: {ALLOWED}"),
    ("t.csv", "arrival_time,prompt_len,output_len\n0,4,2\n0,4,2,7\n", r":3: 4 values, more than the header's 3 columns"),
    ("t.jsonl", '{"arrival_time": 0, "prompt_len": 4, "prompt_token_ids": [1, 2], "output_len": 2}\n',
     r":1: field prompt_len=4 is invalid: must equal the number of prompt_token_ids \(2\) when both are given"),
    ("t.csv", "arrival_time,prompt_len,prompt_token_ids,output_len\n0,3,1 2,2\n",
     r":2: field prompt_len='3' is invalid: must equal the number of prompt_token_ids \(2\)"),
])
def test_replay_refuses_an_unknown_field_and_two_prompt_lengths(name, text, match, tmp_path):
    with raises(re.escape(str(tmp_path / name)) + match):
        trace_workload(tmp_path, name, text)


def test_replay_takes_every_documented_field_and_an_agreeing_prompt_len(tmp_path):
    row = {"request_id": "x", "arrival_time": 0.5, "prompt_token_ids": [1, 2, 3], "prompt_len": 3, "output_len": 2,
           "max_tokens": 4, "priority": 1, "tenant": "t"}
    (r,) = trace_workload(tmp_path, "t.jsonl", json.dumps(row) + "\n").requests
    assert (r.request_id, r.prompt_token_ids, r.sampling_params.max_tokens, r.priority, r.tenant) == \
        ("x", [1, 2, 3], 4, 1, "t")
    w = trace_workload(tmp_path, "t.csv",
                       "arrival_time,prompt_len,prompt_token_ids,output_len\n0,2,5 6,2\n0,3,,2\n")
    assert [r.num_prompt_tokens for r in w.requests] == [2, 3]


# ---- a workload that would hold no requests ---------------------------------------------------------
@pytest.mark.parametrize(("change", "match"), [
    ({"max_prompt_len": 1}, r"^workload\.max_prompt_len=1 is invalid: no session's first prompt fits in it \(the "
                            r"shortest is 8 tokens: 8 of workload\.prompt_len\), so the workload would hold no requests"),
    ({"max_prompt_len": 3072, "system_prompts": {"num": 2, "len": 100_000}},
     r"^workload\.max_prompt_len=3072 is invalid: .*shortest is 100,?008 tokens: workload\.system_prompts\.len=100000 "
     r"plus 8 of workload\.prompt_len\)"),
])
def test_sessions_that_make_no_request_are_refused(change, match):
    with raises(match):
        build({**SESSIONS, **change})


def test_sessions_that_end_early_keep_the_turns_that_fit():
    w = build({**SESSIONS, "max_prompt_len": 8})  # the first turn (8 tokens) fits, the second (20) does not
    assert [r.request_id for r in w.requests] == ["s0-t0", "s1-t0", "s2-t0"]


# ---- a shared prefix longer than the prompts ----------------------------------------------------------
@pytest.mark.parametrize(("prompt_len", "longest"), [
    ({"dist": "fixed", "value": 8}, 8),
    ({"dist": "uniform", "low": 4, "high": 12}, 12),
    ({"dist": "lognormal", "mean": 8, "sigma": 1.0, "min": 2, "max": 16}, 16),
])
def test_a_shared_prefix_longer_than_any_prompt_is_refused(prompt_len, longest):
    with raises(rf"^workload\.shared_prefix_len={longest + 1} is invalid: longer than any prompt workload\.prompt_len "
                rf"can give: must be at most {longest}$"):
        build({**POISSON, "prompt_len": prompt_len, "shared_prefix_len": longest + 1})


def test_a_prompt_shorter_than_the_shared_prefix_is_its_first_tokens():
    w = build({**POISSON, "num_requests": 200, "prompt_len": {"dist": "uniform", "low": 2, "high": 12},
               "shared_prefix_len": 12})
    prefix = max((r.prompt_token_ids for r in w.requests), key=len)
    assert len(prefix) == 12 and all(r.prompt_token_ids == prefix[:r.num_prompt_tokens] for r in w.requests)


# ---- rate: valid or null, whatever the kind -----------------------------------------------------------
OFFLINE_KINDS = {
    "offline": {**POISSON, "arrival": "offline"},
    "tenants": {**POISSON, "tenants": {"names": ["a", "b"], "rates": [1.0, 2.0]}},
    "nanovllm": NANOVLLM,
    "mooncake": MOONCAKE,
}


@pytest.mark.parametrize("cfg", list(OFFLINE_KINDS.values()), ids=list(OFFLINE_KINDS))
@pytest.mark.parametrize("rate", [-1, 0, float("inf"), float("nan"), "fast", True])
def test_an_invalid_rate_is_refused_by_kinds_that_do_not_use_it(cfg, rate):
    with raises(rf"^workload\.rate={re.escape(repr(rate))} is invalid: must be a finite number > 0$"):
        build({**cfg, "rate": rate})


def test_an_invalid_rate_is_refused_by_a_replay(tmp_path):
    with raises(r"^workload\.rate=-1 is invalid: must be a finite number > 0$"):
        trace_workload(tmp_path, "t.jsonl", ROW, rate=-1)


# A trace refuses even a valid rate, its arrivals being its own (test_workload_rate_knobs.py).
UNUSED_RATE_KINDS = {k: v for k, v in OFFLINE_KINDS.items() if k != "mooncake"}


@pytest.mark.parametrize("cfg", list(UNUSED_RATE_KINDS.values()), ids=list(UNUSED_RATE_KINDS))
def test_a_valid_rate_is_left_unused_by_kinds_without_arrivals_at_a_rate(cfg):
    """So that one sweep over workload.rate can take in such workloads too."""
    assert build({**cfg, "rate": 5.0}).rows() == build({**cfg, "rate": None}).rows()
