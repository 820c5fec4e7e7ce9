"""experiments.search (docs/search.md): the bisection on the rate, pruning by memory, the result
cache, the Pareto front, bad input (one line naming the field) and a tiny search end to end."""
from __future__ import annotations

import json
import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from property_settings import examples

from experiments import search as search_module
from experiments.lib.paths import REPO_ROOT
from experiments.lib.search.cache import CACHE_FILE
from experiments.lib.search.capacity import RateProbe, max_sustained_rate
from experiments.lib.search.catalogue import load_catalogue
from experiments.lib.search.pareto import pareto_front
from experiments.lib.search.runner import prune_reason, run_search
from experiments.lib.search.space import Deployment, run_config

# A small model, short requests and 2 s of arrivals per simulation: a deployment costs a few runs.
TINY = ["model=qwen3-0.6b", "workload=poisson", "workload.prompt_len={dist: uniform, low: 16, high: 64}",
        "workload.output_len={dist: uniform, low: 4, high: 16}", "search.duration_s=2",
        "search.rate.max_iterations=3", "search.space.gpu=[h100,a100]", "search.space.tensor_parallel_size=[1]",
        "search.space.replicas=[1,2]", "search.space.max_num_seqs=[8]", "search.space.max_num_batched_tokens=[512]",
        "search.target_rate=5", "search.rate.start_per_replica=4"]


def search_cfg(overrides: list[str], tmp_path):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose("search", [*overrides, f"search.cache_dir={tmp_path / 'cache'}"])


@pytest.mark.parametrize("capacity", [0.3, 7.3, 150.0])
def test_the_bisection_finds_a_known_capacity(capacity):
    """A synthetic deployment that meets its SLOs up to `capacity` req/s: the search brackets it
    within rtol, and never probes more than max_iterations times."""
    probes = []

    def probe(rate: float) -> RateProbe:
        probes.append(rate)
        return RateProbe(rate, rate <= capacity)

    cap = max_sustained_rate(probe, start=2.0, max_iterations=20, rtol=0.02)
    assert cap.rate <= capacity < cap.upper
    assert cap.upper - cap.rate <= 0.02 * cap.upper
    assert len(probes) <= 20
    bounded = max_sustained_rate(probe, start=2.0, max_iterations=3, rtol=1e-6)
    assert len(bounded.probes) == 3 and bounded.rate <= capacity


def test_a_model_that_does_not_fit_is_pruned_with_its_reason(tmp_path):
    cfg = search_cfg(["model=llama-3.1-70b"], tmp_path)
    catalogue = load_catalogue(cfg.catalogue)

    def reason(gpu: str, tp: int) -> str | None:
        d = Deployment(gpu, tp, 1, 64, 2048, "fcfs", "round_robin")
        return prune_reason(run_config(cfg, d, catalogue[gpu]), None, {})

    assert reason("a100", 1).startswith("memory: ")  # 141 GB of weights on one 80 GB GPU
    assert reason("a100", 4) is None
    assert "min_kv_tokens" in prune_reason(run_config(cfg, Deployment("h100", 2, 1, 64, 2048, "fcfs", "round_robin"),
                                                      catalogue["h100"]), 10**7, {})


def test_a_tensor_parallel_size_without_collective_data_is_pruned(tmp_path):
    """latency=operators with the CPU profile: collectives measured at 2 ranks only."""
    cfg = search_cfg(["latency=operators", "latency.gpu=cpu", "latency.dtype=float32"], tmp_path)
    catalogue = load_catalogue(cfg.catalogue)

    def reason(tp: int) -> str | None:
        d = Deployment("h100", tp, 1, 64, 2048, "fcfs", "round_robin")
        return prune_reason(run_config(cfg, d, catalogue["h100"]), None, {})

    assert reason(2) is None
    assert reason(4).startswith("latency: parallel.tensor_parallel_size=4 has no all_reduce data")


def test_collectives_priced_from_the_interconnect_are_labelled_in_the_table(tmp_path):
    """latency.collectives=measured_else_ring: TP 4 runs on the ring model, and the table says so."""
    cfg = search_cfg([*TINY, "latency=operators", "latency.gpu=cpu", "latency.dtype=float32",
                      "latency.collectives=measured_else_ring", "search.space.gpu=[h100]",
                      "search.space.tensor_parallel_size=[2,4]", "search.space.replicas=[1]",
                      "model=tiny-qwen3", "scheduler.max_model_len=2048", "search.rate.max_iterations=1"], tmp_path)
    table = run_search(cfg, tmp_path / "out", progress=False).table.set_index("tensor_parallel_size")
    assert (table["status"] == "simulated").all()
    assert table.loc[2, "latency_data"].endswith("collectives: measured at N=2 (cpu-float32-collectives-n2.csv); "
                                                 "all-reduce: NCCL rows (no symmetric-memory rows in this profile at "
                                                 "N=2; the engine's small messages are faster: one-shot up to "
                                                 "1048576 bytes, two-shot up to 8388608 over symmetric memory); "
                                                 "fused boundary: priced as all-reduce + add_rms_norm (no "
                                                 "all_reduce_add_rms_norm rows in this profile at N=2; the engine "
                                                 "fuses them: take them with python -m experiments.profile "
                                                 "mode=operators operator_parts=[collectives])")
    assert "collectives: ring model at N=4 x measured/model at N=2" in table.loc[4, "latency_data"]


def test_a_rerun_simulates_nothing_and_an_interrupted_one_resumes(tmp_path):
    cfg = search_cfg(TINY, tmp_path)
    first = run_search(cfg, tmp_path / "a", progress=False)
    assert first.summary["simulated"] == 4 and first.summary["cached"] == 0  # 2 GPUs x 2 replica counts
    again = run_search(cfg, tmp_path / "b", progress=False)
    assert again.summary["simulated"] == 0 and again.summary["cached"] == first.summary["simulated"]
    cols = ["gpu", "replicas", "capacity_rps"]
    pd.testing.assert_frame_equal(first.table[cols], again.table[cols])
    cache = tmp_path / "cache" / CACHE_FILE
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[:1]) + "\n" + lines[1][:20])  # interrupted while writing the second
    resumed = run_search(cfg, tmp_path / "c", progress=False)
    assert resumed.summary["cached"] == 1 and resumed.summary["simulated"] == len(lines) - 1
    pd.testing.assert_frame_equal(first.table[cols], resumed.table[cols])


@hyp_settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=30))
def test_the_pareto_front_is_non_dominated_and_covers_every_row(points):
    table = pd.DataFrame({"dollars_per_hour": [float(c) for c, _ in points],
                          "capacity_rps": [float(r) for _, r in points]})
    front = pareto_front(table)
    f = list(zip(front["dollars_per_hour"], front["capacity_rps"]))
    for c, r in f:
        assert not any(c2 <= c and r2 >= r and (c2, r2) != (c, r) for c2, r2 in zip(table["dollars_per_hour"],
                                                                                    table["capacity_rps"]))
    for c, r in zip(table["dollars_per_hour"], table["capacity_rps"]):
        if r > 0:  # every row with a capacity is matched or beaten by a front row
            assert any(c2 <= c and r2 >= r for c2, r2 in f)


def cli_error(args: list[str], tmp_path, monkeypatch, capsys) -> str:
    """`python -m experiments.search args` in this process: its one-line error (exit code 2)."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["search", *args, f"search.cache_dir={tmp_path / 'cache'}",
                                      f"hydra.run.dir={tmp_path / 'out'}"])
    with pytest.raises(SystemExit) as exc:
        search_module.main()
    err = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]  # after the progress bar
    assert exc.value.code == 2 and err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("overrides, match", [
    (["search.slo.ttft_s=1e-6"], "search.slo.ttft_s=1e-06 is met by no deployment"),
    (["latency=operators", "search.space.gpu=[a100]"], "search.space.gpu='a100' has no latency data"),
    (["search.space.gpu=[b200]"], "search.space.gpu[0]='b200' is unknown"),
    (["model=llama-3.1-70b", "search.space.gpu=[a100]"], "model.name='llama-3.1-70b' fits no catalogue GPU"),
    (["latency=operators", "latency.gpu=cpu", "latency.dtype=float32", "search.space.tensor_parallel_size=[4]"],
     "search.space leaves no deployment to simulate: every one is pruned, e.g. latency: parallel.tensor_parallel_size=4"),
    (["search.space.pd_split=[1-1]"], "search.space.pd_split[0]='1-1' is invalid: give 'mixed' or 'P:D'"),
    (["search.space.pd_split=[mixed,2:2]"], "search.space.pd_split[1]='2:2' needs replicas=4"),
    (["search.space.policy=[nope]"], "search.space.policy[0]='nope' is unknown"),
    (["workload=offline"], "workload='offline' is invalid for a search"),
    (["search.slo.goodput=1.5"], "search.slo.goodput=1.5 is invalid"),
    (["catalogue.gpus.h100.price_per_hour=-1"], "catalogue.gpus.h100.price_per_hour=-1 is invalid"),
])
def test_bad_input_is_one_line_naming_the_field(overrides, match, tmp_path, monkeypatch, capsys):
    assert match in cli_error([*TINY, *overrides], tmp_path, monkeypatch, capsys)


def test_a_tiny_search_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["search", *TINY, f"search.cache_dir={tmp_path / 'cache'}",
                                      f"hydra.run.dir={tmp_path / 'out'}", "search.n_jobs=2"])
    search_module.main()
    out = capsys.readouterr().out
    assert "cheapest for 5 req/s:" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    table = pd.read_csv(tmp_path / "out" / "table.csv")
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 0
    assert len(table) == summary["deployments"] == 4  # 2 GPUs x 2 replica counts, one router
    assert (table["capacity_rps"] > 0).all()
    pick = summary["cheapest"]
    able = table[table["capacity_rps"] >= 5]
    assert pick["dollars_per_hour"] == able["dollars_per_hour"].min()
    assert pick["cost_per_million_output_tokens"] > 0


def test_a_latency_profile_retaken_under_the_same_name_is_simulated_again(tmp_path):
    """The cache key holds the latency data's contents, not only its path: results simulated on an
    old operator profile are not reused for a new one."""
    import shutil
    profiles = tmp_path / "operators"
    profiles.mkdir()
    for f in (REPO_ROOT / "experiments" / "profiles" / "operators").glob("h200-bfloat16-*.csv"):
        shutil.copy(f, profiles / f.name)
    cfg = search_cfg([*TINY, "latency=operators", f"latency.dir={profiles}", "search.space.gpu=[h200]",
                      "search.space.replicas=[1]"], tmp_path)
    assert run_search(cfg, tmp_path / "a", progress=False).summary["simulated"] == 1
    assert run_search(cfg, tmp_path / "b", progress=False).summary["cached"] == 1
    collectives = profiles / "h200-bfloat16-collectives-n2-4.csv"
    collectives.write_text(collectives.read_text() + "\n")  # retaken: other bytes under the same name
    again = run_search(cfg, tmp_path / "c", progress=False)
    assert again.summary["simulated"] == 1 and again.summary["cached"] == 0


def test_the_prefill_decode_split_is_a_dimension(tmp_path):
    """"P:D" splits become deployments of P + D replicas with those roles, searched beside mixed ones."""
    cfg = search_cfg([*TINY, "search.space.gpu=[h100]", "search.space.pd_split=[mixed,1:1]",
                      "search.slo.goodput=0.9", "search.slo.tpot_s=0.02"], tmp_path)
    result = run_search(cfg, tmp_path / "out", progress=False)
    table = result.table.set_index(["replicas", "pd_split"])
    assert sorted(table.index) == [(1, "mixed"), (2, "1:1"), (2, "mixed")]
    assert (table["capacity_rps"] > 0).all()
    assert table.loc[(2, "1:1"), "capacity_per_gpu_rps"] == table.loc[(2, "1:1"), "capacity_rps"] / 2
    split = Deployment("h100", 1, 4, 8, 512, "fcfs", "round_robin", "1:3")
    run = run_config(cfg, split, load_catalogue(OmegaConf.to_container(cfg.catalogue))["h100"])
    assert list(run.cluster.roles) == ["prefill", "decode", "decode", "decode"] and run.cluster.replicas == 4
