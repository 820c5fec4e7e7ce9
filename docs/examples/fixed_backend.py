"""A backend whose every step takes a fixed time: the scheduler alone on a simulated clock, with no
latency model. Registered with its config dataclass (the keys of conf/backend/fixed.yaml), it runs
as `python -m experiments.run backend=fixed` and writes the same trace files and summary as the
simulator and the engine.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from experiments.lib import factory
from experiments.lib.backend_run import BackendRun
from experiments.lib.backends import BACKENDS
from experiments.lib.workloads import Workload
from policies.trace import TraceRecorder


@dataclass(kw_only=True)
class FixedBackendConfig:
    name: str = "fixed"
    step_time_s: float = 0.01


@BACKENDS.register("fixed", config=FixedBackendConfig)
def run_fixed(cfg: DictConfig, workload: Workload, recorder: TraceRecorder,
              on_done: Callable[[int], None]) -> BackendRun:
    """Every step takes `backend.step_time_s`, whatever it computes."""
    gpu, cpu = factory.kv_block_counts(cfg)
    scheduler = factory.build_scheduler(cfg, gpu, cpu, recorder)
    step_s = float(cfg.backend.step_time_s)
    requests, stop_lens = workload.requests, workload.stop_lens  # sorted by arrival time
    now, num_steps, next_req = 0.0, 0, 0
    while next_req < len(requests) or scheduler.has_unfinished():
        while next_req < len(requests) and requests[next_req].arrival_time <= now:
            scheduler.add(requests[next_req], now)
            next_req += 1
        if not scheduler.has_unfinished():
            now = requests[next_req].arrival_time  # idle until the next arrival
            continue
        out = scheduler.schedule(now)
        now += step_s
        tokens = {seq.seq_id: [0] * n for seq, _, n in out.scheduled if n}
        ended = scheduler.update(out, tokens, now, output_lens=stop_lens)
        num_steps += 1
        on_done(len(ended))
    return BackendRun(num_steps, now, "simulated", {"num_gpu_blocks": gpu, "num_cpu_blocks": cpu})
