"""The simulated disaggregated fleet (sim/fleet/disagg.py, experiments/lib/disagg_backend.py):
deterministic, TTFT split into its parts, transfers priced from their bytes and queued per link,
every request ending once, bad cluster config named by key."""
from itertools import pairwise

import pandas as pd
import pytest
from hydra import compose, initialize_config_module
from test_sim import Constant

from experiments.lib import factory
from experiments.lib.fleet_backend import cluster_config, run_fleet
from experiments.lib.traces import steps_frame
from experiments.run import run
from policies import Request, SamplingParams, Scheduler, SchedulerConfig, make_block_manager, make_policy
from policies.disagg import ReplicaRole, kv_block_bytes
from policies.routing import make_router
from policies.trace import TraceRecorder
from sim.fleet import ReplicaSpec
from sim.fleet.disagg import DisaggFleetSimulator, HandoffHost
from sim.latency.shapes import Link

SMALL = ["workload.num_requests=40", "progress=false", "plots=false", "seed=5", "cluster.replicas=3",
         "cluster.roles=[prefill,prefill,decode]"]
FILES = ("requests.parquet", "steps.parquet", "events.parquet")


def _cfg(*overrides):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=[*SMALL, *overrides])


def test_runs_are_byte_identical_and_ttft_splits_into_its_parts(tmp_path):
    # Each side acting at once: the link alone prices link_time (the host loops' share: below).
    overrides = ["cluster.link=network", "scheduler.async_scheduling=true", "cluster.handoff_step_boundaries=false"]
    summary = run(_cfg(*overrides), tmp_path / "a", "a")
    run(_cfg(*overrides), tmp_path / "b", "b")
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    rows = pd.read_parquet(tmp_path / "a" / "requests.parquet")
    assert len(rows) == 40 and rows["request_id"].is_unique and (rows["status"] == "finished").all()
    assert (rows["replica"] == 2).all()  # rows are written where requests end: the decode replica
    parts = rows["queueing_time"] + rows["prefill_time"] + rows["transfer_time"]
    assert (rows["ttft"] - parts).abs().max() < 1e-9
    assert ((rows["transfer_time"] - rows["decode_wait"] - rows["link_wait"] - rows["link_time"]).abs() < 1e-9).all()
    cfg = _cfg(*overrides)
    link = factory.hardware(cfg).link("network")
    block = kv_block_bytes(factory.model_shape(cfg), factory.block_size(cfg))
    blocks = -(-rows["prompt_len"] // factory.block_size(cfg))
    assert (rows["transfer_bytes"] == blocks * block).all()
    assert ((rows["link_time"] - rows["transfer_bytes"].map(link.transfer_time)).abs() < 1e-12).all()
    split = summary["disaggregation"]
    assert split["handed_off"] == 40 and summary["run"]["roles"] == ["prefill", "prefill", "decode"]
    counts, per = summary["routing"]["requests_per_replica"], summary["per_replica"]
    assert sum(counts[:2]) == 40 and counts[2] == 40  # arrivals over the prefill replicas; hand-offs received
    assert [per[r]["role"] for r in "012"] == ["prefill", "prefill", "decode"] and per["2"]["received"] == 40
    assert per["0"]["handed_off"] + per["1"]["handed_off"] == 40 and per["0"]["prefills"] == counts[0]
    assert summary["num_gpus"] == 3 and summary["goodput_per_gpu"] == pytest.approx(summary["goodput"] / 3)


def test_transfers_from_one_prefill_replica_queue_at_its_link(tmp_path):
    cfg = _cfg("cluster.replicas=2", "cluster.roles=[prefill,decode]", "hardware.links.nvlink.bandwidth_gb_s=0.5",
               "workload=offline", "cluster.handoff_step_boundaries=false", "cluster.handoff_batch_blocks=1")
    run(cfg, tmp_path, "slow")  # one request per message (each has more than one block)
    rows = pd.read_parquet(tmp_path / "requests.parquet").sort_values("transfer_time")
    assert rows["link_wait"].max() > 0
    start = rows["prefill_time"] + rows["queueing_time"] + rows["arrival_time"] + rows["decode_wait"] + rows["link_wait"]
    spans = sorted(zip(start, start + rows["link_time"]))
    assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in pairwise(spans))  # one at a time


SMALL_POOL_LEN = "scheduler.max_model_len=2080"  # the longest sequence 130 blocks hold (the engine's start-up rule)


def test_a_small_decode_pool_queues_then_aborts_with_a_reason(tmp_path):
    cfg = _cfg("cluster.replicas=2", "cluster.roles=[prefill,decode]", "cluster.handoff_queue=2",
               "blocks.num_gpu_blocks=130", "workload=offline", SMALL_POOL_LEN)
    summary = run(cfg, tmp_path, "small")
    rows = pd.read_parquet(tmp_path / "requests.parquet")
    assert len(rows) == 40 and rows["request_id"].is_unique
    aborted = rows[rows["status"] == "aborted"]
    assert len(aborted) > 0 and set(aborted["finish_reason"]) == {"abort:handoff_queue_full"}
    assert (aborted["replica"] == 0).all()  # dropped hand-offs end on the prefill replica
    assert summary["completed"] + summary["aborted"] == 40
    cfg = _cfg("cluster.replicas=2", "cluster.roles=[prefill,decode]", "blocks.num_gpu_blocks=130", "workload=offline",
               SMALL_POOL_LEN)
    summary = run(cfg, tmp_path / "queued", "queued")
    rows = pd.read_parquet(tmp_path / "queued" / "requests.parquet")
    assert summary["completed"] == 40 and rows["decode_wait"].max() > 0  # waited for blocks, then ran


@pytest.mark.parametrize("queue", ["null", "4"])
def test_a_decode_side_short_of_sequence_slots_pushes_back(queue, tmp_path):
    """By default (cluster.handoff_queue=null) hand-offs that find the decode replica's sequence
    slots taken wait, their KV held by the prefill replica, and every request finishes; a bound
    sheds the hand-offs that find it full."""
    cfg = _cfg("cluster.replicas=2", "cluster.roles=[prefill,decode]", "scheduler.max_num_seqs=4",
               "workload=offline", f"cluster.handoff_queue={queue}")
    assert cluster_config(cfg).handoff_queue == (None if queue == "null" else 4)
    summary = run(cfg, tmp_path, queue)
    rows = pd.read_parquet(tmp_path / "requests.parquet")
    if queue == "null":
        assert summary["completed"] == 40 and rows["decode_wait"].max() > 0
    else:
        assert summary["aborted"] > 0 and set(summary["abort_reasons"]) == {"abort:handoff_queue_full"}


def test_mixed_replicas_serve_beside_a_prefill_decode_pair(tmp_path):
    summary = run(_cfg("cluster.roles=[prefill,decode,mixed]", "backend.fast_forward=false"), tmp_path, "m")
    rows = pd.read_parquet(tmp_path / "requests.parquet")
    assert summary["completed"] == 40 and set(rows["replica"]) == {1, 2}
    assert rows.loc[rows["replica"] == 2, "transfer_time"].isna().all()
    assert rows.loc[rows["replica"] == 1, "transfer_time"].notna().all()


def _host_run(host: HandoffHost):
    """A 1P + 1D pair on a stream that keeps the decode side busy (prefill steps of 10 ms, one arrival
    each 12 ms: one hand-off at a time, no link queue; decode steps of 3 ms): its request rows and each
    replica's step intervals."""
    requests = [Request(f"r{i}", list(range(30 + 7 * (i % 5))), SamplingParams(max_tokens=12, ignore_eos=True),
                        arrival_time=0.012 * i) for i in range(30)]
    specs = [ReplicaSpec(_scheduler(400), Constant(0.01)), ReplicaSpec(_scheduler(400), Constant(0.003))]
    DisaggFleetSimulator(specs, [ReplicaRole.PREFILL, ReplicaRole.DECODE], make_router({"name": "round_robin"}),
                         make_router({"name": "least_kv"}), requests, [Link(10.0, 1e-5), None], [4096, 0],
                         host=host).run()
    rows = pd.DataFrame(specs[1].scheduler.recorder.requests)
    steps = [steps_frame(spec.scheduler.recorder) for spec in specs]
    return rows, [list(zip(s["time"], s["time"] + s["duration"])) for s in steps]


def _inside(t: float, spans) -> bool:
    return any(a + 1e-12 < t < b - 1e-12 for a, b in spans)


def test_each_side_acts_on_a_hand_off_between_its_steps_after_a_message_hop():
    """The engine pair's host loops (sim/fleet/disagg.py, HandoffHost): the hand-off reaches the decode
    side hop_s after the prefill step and is reserved between decode steps; the send starts hop_s
    after that, between prefill steps; the KV is noticed between decode steps."""
    hop = 2e-4
    rows, (prefill_steps, decode_steps) = _host_run(HandoffHost(hop_s=hop, step_boundaries=True))
    assert len(rows) == 30
    prefill_end = rows["arrival_time"] + rows["queueing_time"] + rows["prefill_time"]
    reserved = prefill_end + rows["decode_wait"]
    start = reserved + rows["link_wait"]
    end = start + rows["link_time"]
    assert (rows["decode_wait"] >= hop - 1e-12).all() and (rows["link_wait"] >= hop - 1e-12).all()
    assert not any(_inside(t, decode_steps) for t in reserved)
    assert not any(_inside(t, prefill_steps) for t in start)
    assert not any(_inside(t, decode_steps) for t in end)
    assert (rows["link_time"] >= 4096 * 2 / 10e9).all()
    waited = rows["link_time"] - (rows["transfer_bytes"] / 10e9 + 1e-5)
    assert waited.max() > 1e-4  # some transfers ended mid-step and waited for the decode loop
    # Off, each side acts at once: reserved the moment the hand-off is made (the decode side is never
    # full here), the send starts then, and the link alone prices link_time.
    rows, (_, decode_steps) = _host_run(HandoffHost(hop_s=0.0, step_boundaries=False))
    assert (rows["decode_wait"] == 0).all() and (rows["link_wait"] == 0).all()
    assert ((rows["link_time"] - (rows["transfer_bytes"] / 10e9 + 1e-5)).abs() < 1e-12).all()
    end = rows["arrival_time"] + rows["queueing_time"] + rows["prefill_time"] + rows["transfer_time"]
    assert any(_inside(t, decode_steps) for t in end)  # the same stream: KV lands mid-step when not deferred


def _scheduler(blocks: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_model_len=256), make_policy("fcfs"),
                     make_block_manager("paged", 16, blocks, 0, 0.0, 256), TraceRecorder())


def test_parallel_samples_cross_the_hand_off_and_decode_preemption_recomputes_there():
    requests = [Request(f"r{i}", list(range(40 + i)), SamplingParams(n=1 + i % 3, max_tokens=30, ignore_eos=True),
                        arrival_time=0.001 * i) for i in range(12)]
    specs = [ReplicaSpec(_scheduler(200), Constant(0.01)), ReplicaSpec(_scheduler(30), Constant(0.005))]
    fleet = DisaggFleetSimulator(specs, [ReplicaRole.PREFILL, ReplicaRole.DECODE], make_router({"name": "round_robin"}),
                                 make_router({"name": "least_kv"}), requests, [Link(10.0, 1e-5), None], [4096, 0])
    fleet.run()
    prefill, decode = (spec.scheduler for spec in specs)
    rows = {row["request_id"]: row for row in decode.recorder.requests}
    assert len(rows) == 12 and prefill.recorder.requests == []
    assert all(rows[r.request_id]["output_len"] == 30 * r.sampling_params.n for r in requests)
    assert sum(row["num_preemptions"] for row in rows.values()) > 0  # the small decode pool preempts
    assert prefill.block_manager.num_free_gpu_blocks() == 200 and decode.block_manager.num_free_gpu_blocks() == 30


@pytest.mark.parametrize(("overrides", "match"), [
    (["cluster.roles=[prefill,gpu,decode]"], r"cluster.roles\[1\]='gpu' is not a role"),
    (["cluster.roles=[prefill,decode]"], "2 roles for 3 replicas"),
    (["cluster.roles=[prefill,mixed,mixed]"], "0 decode replicas"),
    (["cluster.decode_router=fastest"], "cluster.decode_router='fastest' is unknown"),
    (["cluster.handoff_queue=0"], "cluster.handoff_queue=0 is invalid: must be an integer >= 1 .* or null"),
    (["cluster.handoff_queue=true"], "cluster.handoff_queue=True is invalid"),
    (["cluster.handoff_batch_blocks=0"], "cluster.handoff_batch_blocks=0 is invalid"),
    (["cluster.handoff_hop_s=-1"], "cluster.handoff_hop_s=-1 is invalid"),
    (["cluster.handoff_step_boundaries=sometimes"], "cluster.handoff_step_boundaries='sometimes' is invalid"),
    (["cluster.handoff_host_s=-0.001"], "cluster.handoff_host_s=-0.001 is invalid"),
])
def test_bad_cluster_config_names_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        cluster_config(_cfg(*overrides))


def test_a_link_missing_from_the_hardware_file_names_it():
    cfg = _cfg("cluster.link=infiniband")
    with pytest.raises(ValueError, match=r"cluster.link='infiniband' is not a link of hardware 'h200'.*nvlink"):
        run_fleet(cfg, factory.workload(cfg), lambda n: None, cluster_config(cfg))


def test_the_engine_fleet_refuses_roles_rather_than_ignore_them():
    from experiments.lib.engine_fleet import run_engine_fleet
    cfg = _cfg("backend=engine")
    with pytest.raises(ValueError, match=r"cluster.roles=\['prefill', 'prefill', 'decode'\] is invalid with backend=engine"):
        run_engine_fleet(cfg, factory.workload(cfg), lambda n: None, cluster_config(cfg))


def test_a_links_overhead_is_paid_once_per_transfer_beside_its_bytes():
    """`overhead_s` (the engine's fixed software cost per message) adds to every transfer's wire
    time once, whatever its size; bad or unknown keys name the field."""
    wire = Link.from_dict({"bandwidth_gb_s": 100.0, "latency_s": 1e-5}, "hardware.links.nvlink")
    priced = Link.from_dict({"bandwidth_gb_s": 100.0, "latency_s": 1e-5, "overhead_s": 2e-3}, "hardware.links.nvlink")
    for num_bytes in (1 << 20, 1 << 28):
        assert priced.transfer_time(num_bytes) - wire.transfer_time(num_bytes) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match=r"hardware.links.nvlink.overhead_s=-1 is invalid"):
        Link.from_dict({"bandwidth_gb_s": 100.0, "latency_s": 0.0, "overhead_s": -1}, "hardware.links.nvlink")
    with pytest.raises(ValueError, match=r"keys \['overhead'\] are unknown"):
        Link.from_dict({"bandwidth_gb_s": 100.0, "latency_s": 0.0, "overhead": 1e-3}, "hardware.links.nvlink")
    assert factory.hardware(_cfg("hardware=h200")).link("nvlink").overhead_s > 0  # measured on 2 x H200


def _batch_run(batch_blocks: int):
    """A 1P + 1D pair, every request arriving at once (a prefill step hands off several), each side
    acting at once; a link with a fixed cost per message."""
    requests = [Request(f"r{i}", list(range(30 + 7 * (i % 5))), SamplingParams(max_tokens=4, ignore_eos=True),
                        arrival_time=0.0) for i in range(8)]
    specs = [ReplicaSpec(_scheduler(400), Constant(0.01)), ReplicaSpec(_scheduler(400), Constant(0.003))]
    DisaggFleetSimulator(specs, [ReplicaRole.PREFILL, ReplicaRole.DECODE], make_router({"name": "round_robin"}),
                         make_router({"name": "least_kv"}), requests, [Link(10.0, 1e-5, 2e-3), None], [4096, 0],
                         host=HandoffHost(hop_s=0.0, step_boundaries=False), batch_blocks=batch_blocks).run()
    return pd.DataFrame(specs[1].scheduler.recorder.requests)


def test_hand_offs_reserved_together_move_as_one_message_paying_the_overhead_once():
    rows = _batch_run(512)
    assert len(rows) == 8
    start = (rows["arrival_time"] + rows["queueing_time"] + rows["prefill_time"] + rows["link_wait"]).round(12)
    messages = rows.groupby(start)
    assert len(messages) < len(rows)  # some requests shared a message
    for _, message in messages:
        assert message["link_time"].nunique() == 1  # they end together
        expected = 1e-5 + 2e-3 + message["transfer_bytes"].sum() / 10e9
        assert message["link_time"].iloc[0] == pytest.approx(expected)
    # One block per message at most: every request alone (each has more blocks), each pays the overhead.
    alone = _batch_run(1)
    queued = alone["link_time"] - (1e-5 + 2e-3 + alone["transfer_bytes"] / 10e9)
    assert (alone["link_wait"] + queued).max() > 2e-3 and (queued.abs() < 1e-12).all()


@pytest.mark.parametrize("ahead", [False, True])
def test_prefill_replicas_schedule_ahead_only_as_the_engine_pairs_prefill_engine_does(monkeypatch, ahead):
    """`cluster.prefill_async_scheduling` sets the prefill replicas' mode on both backends; the
    decode replicas keep the run's (`scheduler.async_scheduling`)."""
    modes = []
    build = factory.build_scheduler

    def recorded(cfg, *args, **kwargs):
        scheduler = build(cfg, *args, **kwargs)
        modes.append(scheduler.config.async_scheduling)
        return scheduler

    monkeypatch.setattr(factory, "build_scheduler", recorded)
    cfg = _cfg("scheduler.async_scheduling=true", f"cluster.prefill_async_scheduling={str(ahead).lower()}")
    result = run_fleet(cfg, factory.workload(cfg), lambda n: None, cluster_config(cfg))
    assert modes == [ahead, ahead, True]
    assert len(result.replica_recorders[2].requests) == 40


def _prefill_gaps(tmp_path, *overrides) -> tuple[list[float], list[int]]:
    """The prefill replica's gaps between consecutive steps and the sequences each earlier step
    prefilled, with every request there at t = 0 (the replica is never idle)."""
    cfg = _cfg("cluster.replicas=2", "cluster.roles=[prefill,decode]", "workload=offline",
               "scheduler.enable_chunked_prefill=false", "scheduler.max_num_batched_tokens=4096",
               *overrides)  # whole prompts: every prompt prefilled is handed off
    run(cfg, tmp_path, "gaps")
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    steps = steps[steps["replica"] == 0].sort_values("time")
    ends = (steps["time"] + steps["duration"]).tolist()
    gaps = [b - a for a, b in zip(ends, steps["time"].tolist()[1:])]
    return gaps, steps["num_prefill_seqs"].tolist()[:-1]


def test_a_synchronous_prefill_replica_pays_its_host_time_per_hand_off_before_its_next_step(tmp_path):
    gaps, handed_off = _prefill_gaps(tmp_path / "sync", "cluster.handoff_host_s=0.01")
    assert len(gaps) > 3 and all(n > 0 for n in handed_off)
    assert gaps == pytest.approx([0.01 * n for n in handed_off], abs=1e-9)
    none, _ = _prefill_gaps(tmp_path / "none", "cluster.handoff_host_s=0")
    assert max(none) == pytest.approx(0.0, abs=1e-9)
    # Scheduling ahead, the next step already runs while the host hands off.
    ahead, _ = _prefill_gaps(tmp_path / "ahead", "cluster.handoff_host_s=0.01", "scheduler.async_scheduling=true",
                             "cluster.prefill_async_scheduling=true")
    assert max(ahead) == pytest.approx(0.0, abs=1e-9)
