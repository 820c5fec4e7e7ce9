"""Workloads with shared prefixes (multi-turn sessions, shared system prompts) and the public trace
importers (Azure LLM inference, BurstGPT, Mooncake): their fixtures, their column mappings, and the
file/line/field errors of bad rows."""
import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from experiments.lib.workloads import build_workload

FIXTURES = "experiments/lib/workloads/fixtures"
VOCAB = 32000
ROOT = Path(__file__).resolve().parents[2]


def sessions_cfg(**kw):
    cfg = {"kind": "sessions", "num_sessions": 12, "rate": 4.0, "turns": {"dist": "uniform", "low": 2, "high": 5},
           "think_time_s": 0.5, "prompt_len": {"dist": "uniform", "low": 5, "high": 40},
           "output_len": {"dist": "uniform", "low": 3, "high": 30}, "max_prompt_len": None,
           "system_prompts": {"num": 3, "len": 20, "zipf": 1.0}, "vocab_size": 1000}
    return {**cfg, **kw}


def test_each_turn_resends_the_conversation_so_far():
    wl = build_workload(sessions_cfg(), seed=1, vocab_size=VOCAB)
    turns: dict[str, list] = {}
    for r, out in zip(wl.requests, wl.output_lens):
        turns.setdefault(r.session_id, []).append((r, out))
        assert r.request_id.startswith(r.session_id + "-t")
    assert len(turns) == 12 and sum(map(len, turns.values())) == len(wl) > 24
    for session in turns.values():
        session.sort(key=lambda ro: int(ro[0].request_id.rsplit("t", 1)[1]))
        for (prev, prev_out), (nxt, _) in pairwise(session):
            assert nxt.arrival_time >= prev.arrival_time
            p, n = prev.prompt_token_ids, nxt.prompt_token_ids
            assert n[:len(p)] == p  # the earlier prompt, then its answer, then new user text
            assert len(n) >= len(p) + prev_out + 5
    # every session starts with one of three system prompts of 20 tokens
    assert len({tuple(s[0][0].prompt_token_ids[:20]) for s in turns.values()}) <= 3
    assert build_workload(sessions_cfg(), seed=1, vocab_size=VOCAB).rows() == wl.rows()
    assert build_workload(sessions_cfg(), seed=2, vocab_size=VOCAB).rows() != wl.rows()


def test_sessions_keep_the_first_turns_by_arrival():
    every = build_workload(sessions_cfg(), 1, VOCAB)
    first = build_workload(sessions_cfg(num_requests=9), 1, VOCAB)
    assert first.rows() == every.rows()[:9]


def test_sessions_end_before_a_prompt_over_the_limit():
    wl = build_workload(sessions_cfg(max_prompt_len=100, turns={"dist": "fixed", "value": 30}), 0, VOCAB)
    assert max(r.num_prompt_tokens for r in wl.requests) <= 100
    assert all(n < 30 for n in Counter(r.session_id for r in wl.requests).values())


def test_system_prompts_are_shared_and_zipf_skewed():
    cfg = {"kind": "synthetic", "num_requests": 400, "arrival": "poisson", "rate": 10.0,
           "prompt_len": {"dist": "fixed", "value": 10}, "output_len": {"dist": "fixed", "value": 5},
           "vocab_size": 1000, "system_prompts": {"num": 5, "len": 32, "zipf": 1.5}}
    wl = build_workload(cfg, 0, VOCAB)
    heads = Counter(tuple(r.prompt_token_ids[:32]) for r in wl.requests)
    assert all(r.num_prompt_tokens == 42 for r in wl.requests)
    counts = [n for _, n in heads.most_common()]
    assert len(counts) == 5 and counts[0] > 2 * counts[-1]  # skewed
    uniform = Counter(tuple(r.prompt_token_ids[:32]) for r in
                      build_workload({**cfg, "system_prompts": {"num": 5, "len": 32, "zipf": 0}}, 0, VOCAB).requests)
    assert max(uniform.values()) < 2 * min(uniform.values())
    # without the spec the draw is the one it always was
    plain = {k: v for k, v in cfg.items() if k != "system_prompts"}
    assert build_workload(plain, 0, VOCAB).requests[0].num_prompt_tokens == 10


@pytest.mark.parametrize("spec, message", [
    ({"num": 0, "len": 4}, "system_prompts.num=0 is invalid"),
    ({"num": 2, "len": 4, "zipf": -1}, "system_prompts.zipf=-1 is invalid"),
    ("many", "system_prompts='many' is invalid"),
])
def test_bad_system_prompts_name_the_key(spec, message):
    with pytest.raises(ValueError, match=message):
        build_workload(sessions_cfg(system_prompts=spec), 0, VOCAB)


def test_azure_maps_timestamp_context_and_generated_tokens():
    wl = build_workload({"kind": "azure", "path": f"{FIXTURES}/azure_llm_2023.csv"}, 0, VOCAB)
    assert len(wl) == 30 and wl.requests[0].arrival_time == 0.0
    # the fixture's first two rows: 18:15:46.6805900 (860, 77) and 18:15:46.8245382 (77, 80)
    assert wl.requests[0].num_prompt_tokens == 860 and wl.output_lens[0] == 77
    assert wl.requests[1].arrival_time == pytest.approx(0.1439482, abs=1e-6)
    assert wl.requests[1].num_prompt_tokens == 77 and wl.output_lens[1] == 80
    assert all(r.sampling_params.max_tokens == n for r, n in zip(wl.requests, wl.output_lens))
    half = build_workload({"kind": "azure", "path": f"{FIXTURES}/azure_llm_2023.csv", "time_scale": 0.5,
                           "num_requests": 5}, 0, VOCAB)
    assert len(half) == 5 and half.requests[1].arrival_time == pytest.approx(wl.requests[1].arrival_time / 2)


def test_azure_2024_timestamps_with_an_offset(tmp_path):
    path = tmp_path / "azure2024.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:01.5+00:00,10,4\n"
                    "2024-05-10 00:00:00.25+00:00,20,3\n")
    wl = build_workload({"kind": "azure", "path": str(path)}, 0, VOCAB)
    assert [r.arrival_time for r in wl.requests] == [0.0, 1.25]  # sorted by time
    assert [r.request_id for r in wl.requests] == ["1", "0"]  # ids are row indices


def test_burstgpt_maps_columns_selects_rows_and_drops_failed_requests():
    base = {"kind": "burstgpt", "path": f"{FIXTURES}/burstgpt.csv"}
    with pytest.raises(ValueError, match=r"burstgpt.csv:9: field Response tokens='0' is invalid: .*drop_empty"):
        build_workload(base, 0, VOCAB)
    with pytest.warns(UserWarning, match="left out 2 rows"):
        wl = build_workload({**base, "drop_empty": True}, 0, VOCAB)
    assert len(wl) == 34
    # first row: Timestamp 5, Request tokens 1676, Response tokens 375
    assert wl.requests[0].arrival_time == 0.0 and wl.requests[0].num_prompt_tokens == 1676
    assert wl.output_lens[0] == 375
    gpt4 = build_workload({**base, "model": "GPT-4", "log_type": "API log"}, 0, VOCAB)  # no failed row
    assert 0 < len(gpt4) < 34
    with pytest.raises(ValueError, match="select no row"):
        build_workload({**base, "model": "Claude"}, 0, VOCAB)


def test_mooncake_hash_ids_become_shared_prefixes():
    wl = build_workload({"kind": "mooncake", "path": f"{FIXTURES}/mooncake.jsonl"}, 3, VOCAB)
    rows = [json.loads(line) for line in (ROOT / FIXTURES / "mooncake.jsonl").read_text().splitlines()]
    assert len(wl) == len(rows) == 32
    by_id = {r.request_id: r for r in wl.requests}
    for k, row in enumerate(rows):
        r = by_id[str(k)]
        assert r.num_prompt_tokens == row["input_length"]
        assert r.arrival_time == pytest.approx((row["timestamp"] - rows[0]["timestamp"]) / 1000)
    for a in range(len(rows)):
        for b in range(a + 1, len(rows)):
            ia, ib = rows[a]["hash_ids"], rows[b]["hash_ids"]
            common = next((i for i, (x, y) in enumerate(zip(ia, ib)) if x != y), min(len(ia), len(ib)))
            pa, pb = by_id[str(a)].prompt_token_ids, by_id[str(b)].prompt_token_ids
            shared = min(common * 512, len(pa), len(pb))
            assert pa[:shared] == pb[:shared]
            if common < min(len(ia), len(ib)):  # a differing block differs
                assert pa[common * 512:common * 512 + 16] != pb[common * 512:common * 512 + 16]
    assert any(r["hash_ids"][0] == rows[0]["hash_ids"][0] for r in rows[1:])  # the fixture shares


@pytest.mark.parametrize("kind, text, message", [
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,4\nyesterday,10,4\n",
     r":3: field TIMESTAMP='yesterday' is invalid"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,ten,4\n",
     r":2: field ContextTokens='ten' is invalid: must be an integer >= 0"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,0\n",
     r":2: field GeneratedTokens='0' is invalid: must be an integer >= 1"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,4\n2023-11-16 18:15:47+00:00,1,1\n",
     r":3: field TIMESTAMP=.* must carry a UTC offset if the first row's does"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n-3,ChatGPT,5,5,10,API log\n",
     r":2: field Timestamp='-3' is invalid: must be a finite number >= 0"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,0,5,5,API log\n",
     r":2: field Request tokens='0' is invalid"),
    ("mooncake", '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}\n',
     r":1: field input_length=600 is invalid: must be at most len\(hash_ids\) x block_tokens = 1 x 512"),
    ("mooncake", '{"timestamp": 0, "input_length": 6, "output_length": 5, "hash_ids": []}\n',
     r":1: field hash_ids=\[\] is invalid"),
    ("mooncake", '{"timestamp": 0, "input_length": 6, "output_length": 5, "hash_ids": [1]}\n{"timestamp": 1,\n',
     r":2: not valid JSON"),
    ("mooncake", '{"timestamp": "soon", "input_length": 6, "output_length": 5, "hash_ids": [1]}\n',
     r":1: field timestamp='soon' is invalid"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, kind, text, message):
    path = tmp_path / ("trace.jsonl" if kind == "mooncake" else "trace.csv")
    path.write_text(text)
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.") + message):
        build_workload({"kind": kind, "path": str(path)}, 0, VOCAB)


@pytest.mark.parametrize("kind, cfg, message", [
    ("azure", {"path": "nowhere.csv"}, "workload.path='nowhere.csv' is invalid: no such file"),
    ("azure", {"path": None}, "workload.path=None is invalid: give a Azure"),
    ("mooncake", {"path": f"{FIXTURES}/azure_llm_2023.csv"}, "a Mooncake trace is .jsonl"),
    ("mooncake", {"path": f"{FIXTURES}/mooncake.jsonl", "block_tokens": 0}, "workload.block_tokens=0 is invalid"),
    ("burstgpt", {"path": f"{FIXTURES}/burstgpt.csv", "drop_empty": "yes"}, "workload.drop_empty='yes' is invalid"),
])
def test_bad_importer_configs_name_the_key(kind, cfg, message):
    with pytest.raises(ValueError, match=message):
        build_workload({"kind": kind, **cfg}, 0, VOCAB)
