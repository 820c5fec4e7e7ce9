"""`backend=engine` with `cluster.roles=[prefill,decode]`: the workload through a real engine pair
(engine/disagg/: a prefill engine on the backend's device in this process, a decode engine on the
next GPU in its own), on the wall clock, with the traces a simulated disaggregated fleet writes
(docs/disaggregation.md): `requests.parquet` with the `replica` column (0: prefill, 1: decode) and
the hand-off columns (TTFT split into queueing, prefill and transfer; the transfer's parts and bytes)
and `summary.json`'s `disaggregation` section, so one notebook compares the two.

The prefill engine's scheduler is the run's (`factory.build_scheduler`), scheduling synchronously,
or ahead with `cluster.prefill_async_scheduling` (docs/disaggregation-engine.md); the decode
engine's is built from the same engine arguments (policy, block manager, limits), with `cluster.handoff_queue` and `cluster.handoff_timeout_s`
bounding its hand-off queue by the simulator's rule (policies/disagg/decode_side.py: null, backpressure alone). Request and step rows come from both engines
(`steps.parquet`'s replica 1: the decode engine's steps, on the same clock); events are the
prefill engine's (the decode engine records none). The run's t=0 is when the pair is ready: both
engines built and the KV link warm (`DisaggregatedEngine.reset_clock`).
"""
from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig

from engine.disagg.config import DisaggregationConfig
from engine.disagg.pd_engine import DisaggregatedEngine
from experiments.lib import factory
from experiments.lib.backend_run import BackendRun
from experiments.lib.engine_backend import (
    OTHER_DEVICE_HOLDERS,
    engine_args,
    engine_info,
    feed_workload,
    release_engine,
)
from experiments.lib.fleet_backend import ClusterConfig, prefill_scheduler_config
from experiments.lib.workloads import Workload
from policies.disagg import ReplicaRole
from policies.scheduler import Scheduler
from policies.trace import TraceRecorder


def run_engine_pair(cfg: DictConfig, workload: Workload, recorder: TraceRecorder,
                    on_done: Callable[[int], None], cluster: ClusterConfig) -> BackendRun:
    """`cluster`: the run's checked `ClusterConfig` (fleet_backend.py `cluster_config`)."""
    if tuple(cluster.roles) != (ReplicaRole.PREFILL, ReplicaRole.DECODE):
        raise ValueError(f"cluster.roles={[r.value for r in cluster.roles]} is not supported with backend=engine: "
                         "the engine runs one prefill and one decode replica ([prefill, decode])")
    prefill_cfg = prefill_scheduler_config(cfg, cluster)

    def build(gpu: int, cpu: int, _: int) -> Scheduler:
        return factory.build_scheduler(prefill_cfg, gpu, cpu, recorder, workload)

    release_engine()  # one model per device: the kept single engine and the engine fleet's replicas go
    for release in OTHER_DEVICE_HOLDERS:
        release()
    config = DisaggregationConfig(max_queue=cluster.handoff_queue, queue_timeout_s=cluster.handoff_timeout_s,
                                  max_blocks_per_transfer=cluster.handoff_batch_blocks,
                                  prefill_async_scheduling=cluster.prefill_async_scheduling,
                                  sends_mid_step=cluster.prefill_sends_mid_step)
    args = engine_args(cfg)
    pair = DisaggregatedEngine(args, config, build)
    try:
        pair.reset_clock()  # the run's t=0: the pair is ready (engines built, the KV link warm)
        num_steps = feed_workload(pair, workload, on_done)
        decode = TraceRecorder()
        decode.requests.extend(pair.decode_rows)
        decode.steps.extend(pair.decode_steps)
        runner = pair.prefill.runner
        info = {**engine_info(runner), "replicas": 2, "roles": ["prefill", "decode"],
                "decode_device": pair.decode_device, "link_warm_s": pair.link_warm.seconds,
                "prefill_async_scheduling": config.prefill_async_scheduling,
                "sends_mid_step": config.sends_mid_step,
                "prefill_steps_ahead": pair.prefill.scheduler.num_scheduled_ahead,
                "join_ahead": args.join_ahead,  # the decode engine's rule for received requests
                "replica_info": [{"replica": 0, "role": "prefill", "num_gpu_blocks": runner.num_gpu_blocks},
                                 {"replica": 1, "role": "decode", "num_gpu_blocks": pair.decode_num_gpu_blocks}]}
        elapsed = pair.now()
    finally:
        pair.close()
    return BackendRun(num_steps, elapsed, "wall", info, [recorder, decode])
