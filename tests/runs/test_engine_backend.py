"""`backend=engine` on CPU: a workload through the real engine on the wall clock writes the same
trace files as the simulator, honours arrival times and the workload's stop lengths, and
`experiments.ab` compares two engine configs on one request stream."""
from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from experiments.ab import _main as ab_main
from experiments.lib import engine_backend, factory
from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.run_workload import run

ENGINE = ["backend=engine", "model=tiny-qwen3", "blocks.num_gpu_blocks=256", "blocks.swap_space_gib=0.01",
          "scheduler.max_model_len=256", "progress=false", "plots=false"]
WORKLOAD = ["workload=poisson", "workload.num_requests=12", "workload.rate=40", "workload.prompt_len.low=4",
            "workload.prompt_len.high=40", "workload.output_len.low=2", "workload.output_len.high=16",
            "workload.max_tokens=24"]



def test_engine_backend_writes_sim_traces_on_the_wall_clock(tmp_path):
    cfg = compose_cfg([*ENGINE, *WORKLOAD])
    workload = factory.workload(cfg)
    summary = run(cfg, tmp_path, "engine")
    for name in ("requests.parquet", "steps.parquet", "events.parquet", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["clock"] == "wall"
    assert summary["completed"] == 12 and summary["run"]["backend"] == "engine"
    assert summary["run"]["num_gpu_blocks"] == 256
    assert summary["run"]["decode_kernel"] == "packed"  # "auto" on the CPU
    assert summary["config"]["scheduler"]["async_scheduling"]  # the default configuration
    assert "all_reduce" not in summary["run"]  # one GPU: no all-reduce to record
    req = pd.read_parquet(tmp_path / "requests.parquet").set_index("request_id")
    for r, out_len in zip(workload.requests, workload.output_lens):
        row = req.loc[r.request_id]
        assert row.arrival_time == pytest.approx(r.arrival_time)
        assert row.output_len == out_len  # the workload's length, not max_tokens=24
        assert row.finish_reason == ("stop" if out_len < 24 else "length")
        assert row.first_token_time >= row.arrival_time and row.finish_time >= row.first_token_time
        assert row.first_scheduled_time >= r.arrival_time  # nobody enters before its arrival time
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    assert steps.num_batched_tokens.sum() >= sum(r.num_prompt_tokens for r in workload.requests)


def test_a_tensor_parallel_engine_run_records_its_all_reduce_path(tmp_path):
    """The engine's own choice, as rank 0 logs it: gloo ranks stay off the symmetric-memory paths,
    and the run says why (experiments.fidelity prices what the engine ran from this record)."""
    cfg = compose_cfg([*ENGINE, *WORKLOAD, "workload.num_requests=3", "parallel.tensor_parallel_size=2"])
    try:
        run(cfg, tmp_path, "engine")
    finally:
        engine_backend.release_engine()
    recorded = json.loads((tmp_path / "summary.json").read_text())["run"]["all_reduce"]
    assert recorded == {"path": "nccl", "world_size": 2,
                        "reason": "device cpu is not a GPU (gloo carries the all-reduces)"}


def test_ab_on_the_engine_backend(tmp_path):
    # A tiny pool forces preemptions: recompute (A) vs swap (B) on the same request stream.
    # (all requests arrive within a millisecond, so the pressure does not depend on the step speed).
    common = [*ENGINE, *WORKLOAD, "workload.rate=20000", "blocks.num_gpu_blocks=20", "blocks.block_size=4",
              "scheduler.max_model_len=64", "blocks.num_cpu_blocks=200"]
    result = ab_main(["a=[policy.preemption_mode=recompute]", "b=[policy.preemption_mode=swap]", *common,
                      "--out", str(tmp_path), "--resamples", "50"])
    assert result.summary_a["run"]["backend"] == "engine" == result.summary_b["run"]["backend"]
    assert result.summary_a["completed"] == result.summary_b["completed"] == 12
    assert result.summary_b["run"]["num_cpu_blocks"] == 200
    steps_b = pd.read_parquet(tmp_path / "b" / "steps.parquet")
    assert steps_b.num_preempted_swap.sum() > 0
    assert (tmp_path / "ab.md").is_file()
    assert (tmp_path / "_warmup" / "requests.parquet").is_file()  # the engine ran A once before the record
    assert not (tmp_path / "_warmup_b").exists()  # B runs on the same engine: no second warm-up


@pytest.mark.parametrize(("ahead", "join"), [(False, True), (True, False)])
def test_engine_pair_writes_the_disaggregated_fleet_traces(tmp_path, ahead, join):
    """cluster.roles=[prefill,decode] on backend=engine: a prefill and a decode engine; the traces
    carry the replica and hand-off columns, with the workload's stop lengths kept across the hand-off,
    and both engines' steps on the run's clock (replica 1: the decode engine's). `ahead`: the prefill
    engine schedules ahead (cluster.prefill_async_scheduling); its steps still hold prefills only.
    `join`: scheduler.join_ahead, the decode engine's rule for received requests (summary.json)."""
    cfg = compose_cfg([*ENGINE, *WORKLOAD, "cluster.replicas=2", "cluster.roles=[prefill,decode]",
                       f"cluster.prefill_async_scheduling={str(ahead).lower()}",
                       f"scheduler.join_ahead={str(join).lower()}"])
    workload = factory.workload(cfg)
    summary = run(cfg, tmp_path, "pair")
    assert summary["completed"] == 12 and summary["run"]["roles"] == ["prefill", "decode"]
    assert summary["num_gpus"] == 2 and summary["disaggregation"]["handed_off"] >= 10
    assert summary["run"]["prefill_async_scheduling"] is ahead and summary["run"]["join_ahead"] is join
    assert (summary["run"]["prefill_steps_ahead"] > 0) is ahead
    req = pd.read_parquet(tmp_path / "requests.parquet").set_index("request_id")
    for r, out_len in zip(workload.requests, workload.output_lens):
        row = req.loc[r.request_id]
        assert row.output_len == out_len and row.finish_reason == ("stop" if out_len < 24 else "length")
        if row.replica == 1:  # handed off: TTFT = queueing + prefill + transfer
            assert row.ttft == pytest.approx(row.queueing_time + row.prefill_time + row.transfer_time, abs=1e-6)
            assert row.transfer_bytes > 0 and row.link_time >= 0
        else:  # ended at its first token, on the prefill engine
            assert out_len == 1
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    decode, prefill = steps[steps.replica == 1], steps[steps.replica == 0]
    assert len(decode) and len(prefill) and (prefill.num_prefill_tokens > 0).all()
    assert (decode.num_decode_seqs > 0).all() and (decode.duration >= 0).all()
    handed = req[req.replica == 1]
    assert decode.time.min() >= handed.first_token_time.min() - 1e-9
    assert decode.time.max() <= handed.finish_time.max() + 1e-9
    assert decode.num_batched_tokens.sum() == (handed.output_len - 1).sum()


def test_cpu_run_of_a_real_size_model_says_so_before_it_starts():
    """A real-size model on the CPU's reference kernels is silent for minutes otherwise: the run
    names the model, its size and the quick alternatives; tiny models and GPUs get no note."""
    cfg = compose_cfg(["backend=engine", "model=qwen3-0.6b", "blocks.num_gpu_blocks=256"])
    note = engine_backend.cpu_run_note(engine_backend.engine_args(cfg), 500)
    assert note is not None and "qwen3-0.6b" in note and "500 requests" in note
    assert "model=tiny-qwen3" in note and "backend.device=cuda" in note
    assert engine_backend.cpu_run_note(engine_backend.engine_args(compose_cfg(ENGINE)), 500) is None
    on_gpu = dataclasses.replace(engine_backend.engine_args(cfg), device="cuda")
    assert engine_backend.cpu_run_note(on_gpu, 500) is None


def test_engine_run_prints_the_cpu_note(tmp_path, capsys, monkeypatch):
    """The note reaches stderr before the engine is built (a stand-in engine: no 0.6B weights here)."""
    cfg = compose_cfg(["backend=engine", "model=qwen3-0.6b", "blocks.num_gpu_blocks=256", *WORKLOAD[:3]])

    class Built(Exception):
        pass

    def no_engine(*_):
        raise Built

    monkeypatch.setattr(engine_backend, "get_engine", no_engine)
    with pytest.raises(Built):
        engine_backend.run_engine(cfg, factory.workload(cfg), None, lambda n: None)
    assert "note: backend=engine runs qwen3-0.6b" in capsys.readouterr().err
