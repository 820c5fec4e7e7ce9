"""Workloads: nano-vllm's exact draw, arrival and length distributions, priority classes, replay errors."""
import json

import numpy as np
import pytest
from workload_helpers import trace_workload

from experiments.lib.workloads import build_workload

BASE = {"kind": "synthetic", "name": "t", "num_requests": 200, "arrival": "poisson", "rate": 10.0, "burstiness": 1.0,
            "prompt_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed", "value": 4},
            "max_tokens": None, "priority": None, "shared_prefix_len": 0, "vocab_size": 10000, "seed": None}


def build(**kw):
    return build_workload({**BASE, **kw}, seed=0, vocab_size=151936)


def test_nanovllm_bench_totals():
    w = build_workload({"kind": "nanovllm", "num_requests": 256, "max_input_len": 1024, "max_output_len": 1024,
                        "seed": 0}, seed=123, vocab_size=151936)
    assert len(w) == 256
    assert sum(r.num_prompt_tokens for r in w.requests) == 142_827
    assert sum(r.sampling_params.max_tokens for r in w.requests) == 133_966
    assert all(r.sampling_params.ignore_eos and r.sampling_params.temperature == 0.6 for r in w.requests)
    assert all(r.arrival_time == 0.0 for r in w.requests)
    assert max(max(r.prompt_token_ids) for r in w.requests) <= 10000


def gaps(w):
    return np.diff([r.arrival_time for r in w.requests])


def test_poisson_and_gamma_arrivals():
    g = gaps(build(num_requests=20000, rate=50.0))
    assert g.mean() == pytest.approx(1 / 50, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    g = gaps(build(num_requests=20000, arrival="gamma", rate=50.0, burstiness=0.25))
    assert g.mean() == pytest.approx(1 / 50, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(2.0, rel=0.08)  # CV = 1/sqrt(shape)
    assert all(r.arrival_time == 0 for r in build(arrival="offline", rate=None).requests)
    assert build().requests[0].arrival_time == 0.0


def test_length_distributions():
    w = build(num_requests=5000, prompt_len={"dist": "uniform", "low": 3, "high": 7},
              output_len={"dist": "lognormal", "mean": 100, "sigma": 0.5, "min": 1, "max": 100000})
    p = np.array([r.num_prompt_tokens for r in w.requests])
    assert p.min() == 3 and p.max() == 7
    assert np.bincount(p)[3:].min() > 800  # all five values, roughly uniform
    o = np.array(w.output_lens)
    assert o.mean() == pytest.approx(100, rel=0.03)
    assert np.log(o).std() == pytest.approx(0.5, rel=0.05)
    assert [r.sampling_params.max_tokens for r in w.requests] == w.output_lens
    clipped = build(output_len={"dist": "lognormal", "mean": 100, "sigma": 2, "min": 5, "max": 50})
    assert min(clipped.output_lens) >= 5 and max(clipped.output_lens) <= 50


def test_priority_classes_and_shared_prefix():
    w = build(num_requests=4000, priority={"values": [0, 5], "weights": [1, 3]}, shared_prefix_len=6,
              prompt_len={"dist": "uniform", "low": 4, "high": 20})
    prios = np.array([r.priority for r in w.requests])
    assert set(prios) == {0, 5}
    assert (prios == 0).mean() == pytest.approx(0.25, abs=0.03)
    prefix = max(w.requests, key=lambda r: r.num_prompt_tokens).prompt_token_ids[:6]
    for r in w.requests:
        assert r.prompt_token_ids[:6] == prefix[:r.num_prompt_tokens]
    assert len({tuple(r.prompt_token_ids[6:]) for r in w.requests if r.num_prompt_tokens > 12}) > 100


def test_max_tokens_cap_gives_stop_lengths():
    w = build(output_len={"dist": "uniform", "low": 1, "high": 50}, max_tokens=40)
    assert all(r.sampling_params.max_tokens == 40 for r in w.requests)
    assert max(w.output_lens) <= 40
    assert w.stop_lens == {r.request_id: n for r, n in zip(w.requests, w.output_lens) if n < 40}


def test_seeded_and_fresh_copies():
    a, b = build(seed=None), build(seed=None)
    assert [(r.arrival_time, r.prompt_token_ids) for r in a.requests] == \
           [(r.arrival_time, r.prompt_token_ids) for r in b.requests]
    c = build_workload({**BASE}, seed=1, vocab_size=151936)
    assert [r.arrival_time for r in c.requests] != [r.arrival_time for r in a.requests]
    fresh = a.fresh()
    assert fresh.requests[0] is not a.requests[0] and fresh.rows() == a.rows()


@pytest.mark.parametrize("kw, key", [
    ({"rate": -1.0}, "workload.rate=-1.0"),
    ({"arrival": "gamma", "burstiness": 0}, "workload.burstiness=0"),
    ({"arrival": "weibull"}, "workload.arrival='weibull'"),
    ({"num_requests": 0}, "workload.num_requests=0"),
    ({"prompt_len": {"dist": "zipf"}}, "workload.prompt_len.dist='zipf'"),
    ({"output_len": {"dist": "uniform", "low": 9, "high": 2}}, "workload.output_len.high=2"),
    ({"priority": {"values": [0, 1], "weights": [1]}}, "workload.priority.weights"),
    ({"kind": "nope"}, "workload.kind='nope'"),
])
def test_bad_config_names_the_key(kw, key):
    with pytest.raises(ValueError, match="^" + key.replace("[", r"\[").replace(".", r"\.")):
        build(**kw)


def test_replay_csv_and_jsonl(tmp_path):
    w = trace_workload(tmp_path, "t.csv",
                       "arrival_time,prompt_len,output_len,priority\n0.5,10,3,1\n0.1,4,2,\n")
    assert [r.request_id for r in w.requests] == ["1", "0"]  # sorted by arrival
    assert [r.num_prompt_tokens for r in w.requests] == [4, 10] and w.output_lens == [2, 3]
    assert [r.priority for r in w.requests] == [0, 1]
    rows = [{"request_id": "x", "arrival_time": 0, "prompt_token_ids": [1, 2, 3], "output_len": 5, "max_tokens": 9}]
    w = trace_workload(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n", time_scale=2.0)
    assert w.requests[0].prompt_token_ids == [1, 2, 3] and w.stop_lens == {"x": 5}


@pytest.mark.parametrize("name, text, match", [
    ("a.csv", "arrival_time,prompt_len,output_len\n0,5,2\n-1,5,2\n", r"a.csv:3: field arrival_time='-1'"),
    ("b.csv", "arrival_time,prompt_len,output_len\n0,five,2\n", r"b.csv:2: field prompt_len='five'"),
    ("c.csv", "arrival_time,prompt_len,output_len\n0,5,0\n", r"c.csv:2: field output_len='0'"),
    ("d.jsonl", '{"arrival_time": 0, "prompt_len": 3, "output_len": 2}\n{"arrival_time": 1, "output_len": 2',
     r"d.jsonl:2: not valid JSON"),
    ("e.jsonl", '{"arrival_time": 0, "prompt_token_ids": [1, 5000], "output_len": 2}\n',
     r"e.jsonl:1: field prompt_token_ids=\[1, 5000\]"),
    ("f.jsonl", '{"arrival_time": 0, "output_len": 2}\n', r"f.jsonl:1: field prompt_len=None"),
    ("g.jsonl", ('{"request_id": "a", "arrival_time": 0, "prompt_len": 1, "output_len": 2}\n'
                '{"request_id": "a", "arrival_time": 0, "prompt_len": 1, "output_len": 2}\n'),
     r"g.jsonl:2: field request_id='a' is invalid: must be unique"),
    ("h.txt", "x", r"workload.path='.*h.txt' is invalid: must end in .csv or .jsonl"),
])
def test_replay_errors_name_line_and_field(tmp_path, name, text, match):
    with pytest.raises(ValueError, match=match):
        trace_workload(tmp_path, name, text)


TENANTS = {"kind": "synthetic", "num_requests": 40, "arrival": "poisson", "rate": 1.0,
           "prompt_len": {"dist": "uniform", "low": 4, "high": 40},
           "output_len": {"dist": "lognormal", "mean": 50, "sigma": 1.0, "min": 2, "max": 500},
           "vocab_size": 1000, "tenants": {"names": ["heavy", "light"], "rates": [9.0, 1.0]}}


def test_tenant_streams_are_independent():
    """Each tenant is its own stream: ids `<tenant>-<k>`, counts split by rate, and the light
    tenant's requests alone (its solo run) are exactly its requests of the shared run."""
    both = build_workload(TENANTS, 7, 1000)
    by_tenant = {}
    for r, n in zip(both.requests, both.output_lens):
        by_tenant.setdefault(r.tenant, []).append((r.request_id, r.arrival_time, r.prompt_token_ids, n))
    assert (len(by_tenant["heavy"]), len(by_tenant["light"])) == (36, 4)
    assert by_tenant["light"][0][0] == "light-0"
    assert [r.arrival_time for r in both.requests] == sorted(r.arrival_time for r in both.requests)
    solo = build_workload({**TENANTS, "tenants": {"names": ["light"], "rates": [1.0], "num_requests": [4]}}, 7, 1000)
    assert [(r.request_id, r.arrival_time, r.prompt_token_ids, n)
            for r, n in zip(solo.requests, solo.output_lens)] == by_tenant["light"]


@pytest.mark.parametrize(("change", "match"), [
    ({"names": ["a", "a"], "rates": [1.0, 1.0]}, "workload.tenants.names"),
    ({"names": ["a"], "rates": [0.0]}, "workload.tenants.rates"),
    ({"names": ["a"], "rates": [1.0], "num_requests": [0]}, "workload.tenants.num_requests"),
])
def test_bad_tenants(change, match):
    with pytest.raises(ValueError, match=match):
        build_workload({**TENANTS, "tenants": change}, 0, 1000)


def test_length_correlation():
    cfg = {**TENANTS, "tenants": None, "num_requests": 2000, "length_correlation": 0.8,
           "prompt_len": {"dist": "lognormal", "mean": 100, "sigma": 1.0, "min": 1, "max": 100000},
           "output_len": {"dist": "lognormal", "mean": 100, "sigma": 1.0, "min": 1, "max": 100000}}
    w = build_workload(cfg, 0, 1000)
    logs = np.log([[r.num_prompt_tokens for r in w.requests], w.output_lens])
    assert 0.75 < np.corrcoef(logs)[0, 1] < 0.85
    with pytest.raises(ValueError, match="length_correlation needs lognormal"):
        build_workload({**TENANTS, "tenants": None, "length_correlation": 0.5}, 0, 1000)


def test_replay_tenant_field(tmp_path):
    w = trace_workload(tmp_path, "t.jsonl", '{"arrival_time": 0, "prompt_len": 3, "output_len": 2, '
                       '"tenant": "acme"}\n{"arrival_time": 1, "prompt_len": 3, "output_len": 2}\n')
    assert [r.tenant for r in w.requests] == ["acme", None]
