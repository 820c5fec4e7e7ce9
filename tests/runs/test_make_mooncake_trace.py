"""The synthetic Mooncake-style trace (experiments/make_mooncake_trace.py): the public trace's
statistics, the layout's rules for hash ids, determinism, the importer reading it, bad options."""
import json
import math

import pytest

from experiments import make_mooncake_trace as mk
from experiments.lib.workloads import build_workload


def test_one_hour_has_the_public_traces_statistics():
    rows = mk.make_trace(mk.MooncakeTraceSpec(hours=1, seed=0))
    stats = mk.trace_stats(rows)
    assert abs(stats["requests"] / 23608 - 1) < 0.03
    assert 3590 < stats["duration_s"] < 3600
    assert abs(stats["mean_input"] / 7590 - 1) < 0.03
    assert abs(stats["mean_output"] / 182 - 1) < 0.03
    assert 0.45 < stats["repeated_block_fraction"] < 0.55  # ~183k distinct of ~360k block references
    assert abs(stats["distinct_blocks"] / 183_000 - 1) < 0.05
    times = [r["timestamp"] for r in rows]
    assert times == sorted(times) and times[0] == 0


def test_hash_ids_are_512_token_blocks_new_ids_counting_up_and_shared_prefixes():
    rows = mk.make_trace(mk.MooncakeTraceSpec(hours=0.05, seed=3))
    top, first_seen, continued = -1, {}, 0
    for k, row in enumerate(rows):
        ids = row["hash_ids"]
        assert len(ids) == math.ceil(row["input_length"] / mk.BLOCK_TOKENS)
        assert 1 <= row["output_length"] <= 2048
        old = [h for h in ids if h <= top]
        assert ids[:len(old)] == old  # seen blocks only lead the prompt ...
        assert ids[len(old):] == list(range(top + 1, top + 1 + len(ids) - len(old)))  # ... new ones count up
        if old:
            continued += 1
            parent = rows[first_seen[old[-1]]]["hash_ids"]
            assert parent[:len(old)] == old  # the run of an earlier request's leading blocks
        for h in ids:
            first_seen.setdefault(h, k)
        top = max(top, *ids)
    assert 0.6 * len(rows) < continued < 0.95 * len(rows)


def test_the_trace_is_seeded():
    spec = mk.MooncakeTraceSpec(hours=0.02, seed=5)
    assert mk.make_trace(spec) == mk.make_trace(spec)
    assert mk.make_trace(spec) != mk.make_trace(mk.MooncakeTraceSpec(hours=0.02, seed=6))


def test_the_importer_turns_its_hash_ids_into_shared_prompt_prefixes(tmp_path, capsys):
    out = tmp_path / "trace.jsonl"
    mk.main(["--hours", "0.01", "--out", str(out), "--seed", "1"])
    assert f"wrote {out}: requests" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    wl = build_workload({"kind": "mooncake", "path": str(out)}, 0, 1000)
    assert [len(r.prompt_token_ids) for r in wl.requests] == [row["input_length"] for row in rows]
    assert [r.arrival_time for r in wl.requests] == pytest.approx([row["timestamp"] / 1000 for row in rows])
    a, b = next((i, j) for j in range(len(rows)) for i in range(j)
                if rows[i]["hash_ids"][0] == rows[j]["hash_ids"][0] and rows[i]["input_length"] > 512)
    assert wl.requests[a].prompt_token_ids[:512] == wl.requests[b].prompt_token_ids[:512]


@pytest.mark.parametrize("args, message", [
    (["--share", "2"], "--share=2.0 is invalid: must be a number in [0, 1]"),
    (["--max-input", "0"], "--max-input=0 is invalid: must be an integer >= 1"),
    (["--hours", "-1"], "--hours=-1.0 is invalid: must be a number > 0"),
    (["--out", "trace.csv"], "a Mooncake trace is a .jsonl file"),
    (["--mean-input", "200000"], "--mean-input=200000.0 is invalid: above max-input=129024"),
    (["--mean-output", "100", "--max-output", "50"], "--mean-output=100.0 is invalid: above max-output=50"),
])
def test_bad_options_are_one_line_naming_the_option(tmp_path, capsys, args, message):
    argv = ["--out", str(tmp_path / "t.jsonl"), *args]
    with pytest.raises(SystemExit) as exit_info:
        mk.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
