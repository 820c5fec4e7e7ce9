"""backend=sim with `cluster.replicas` > 1: the simulated fleet (sim/fleet/) built from the config.

Each replica gets the run's scheduler, block manager and latency model, built by `factory` from the
run's config with its own `hardware` (`cluster.hardware`: one conf/hardware name per replica) and
its own trace recorder; the `router` group builds the router (policies/routing/), seeded by the
run's seed. Returns a `BackendRun` whose `replica_recorders` hold each replica's traces (written
with a `replica` column by experiments/lib/traces.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import inf

from omegaconf import DictConfig, OmegaConf, open_dict

from experiments.lib import factory
from experiments.lib.paths import REPO_ROOT, resolve_path
from experiments.lib.serving_overhead import ServingOverhead
from experiments.lib.workloads import Workload
from policies.disagg import ReplicaRole, check_max_queue, is_disaggregated, parse_roles
from policies.trace import TraceRecorder

HARDWARE_DIR = REPO_ROOT / "conf" / "hardware"


@dataclass(slots=True, frozen=True)
class ClusterConfig:
    replicas: int = 1
    hardware: tuple[str, ...] | None = None  # per replica; None: the run's hardware for all
    refresh_s: float = 0.0  # router snapshot refresh period (0: exact)
    # Prefill/decode disaggregation (docs/disaggregation.md): one role per replica (all mixed by default).
    roles: tuple[ReplicaRole, ...] = ()
    decode_router: str = "least_kv"  # a conf/router name: picks the decode replica of each hand-off
    link: str = "nvlink"  # a conf/hardware `links` name: what a KV transfer crosses
    # Hand-offs waiting on one decode replica (for a sequence slot and KV blocks), at most; None:
    # unbounded, the prefill side holding their KV (backpressure) up to handoff_timeout_s
    handoff_queue: int | None = None
    handoff_timeout_s: float = 60.0  # how long one may wait there (longer: aborted)
    handoff_hop_s: float = 1e-4  # backend=sim: one message between a pair's host loops (sim/fleet/disagg.py)
    handoff_step_boundaries: bool = True  # backend=sim: each side acts on a hand-off between its steps
    handoff_host_s: float = 0.0  # backend=sim: a synchronous prefill replica's host time per hand-off
    handoff_batch_blocks: int = 512  # hand-offs reserved at once move as one KV message, up to this many blocks
    dispatch_hop_s: float = 6e-4  # backend=sim: arrival -> routed and at its replica (sim/fleet/fleet.py)
    # backend=engine: the engine pair's prefill engine schedules ahead (disaggregation.prefill_async_scheduling)
    prefill_async_scheduling: bool = False
    # backend=sim: what a KV message costs the engines beside the link (sim/latency/kv_receive.py):
    # None (nothing), 'hardware' or a receive profile's path
    kv_receive_profile: str | None = None
    # backend=sim: a synchronous prefill replica admits the requests that arrived during a step before
    # its next one (its latency model's admission_s each), as the engine pair's front does
    prefill_admits_between_steps: bool = False
    # backend=sim: the front's host time per decode output and per decode-step message it reads
    # between a prefill replica's steps (sim/fleet/front_reads.py)
    front_token_host_s: float = 0.0
    front_message_host_s: float = 0.0
    # backend=sim: the front's host loop priced unit by unit from a measured profile
    # (sim/fleet/front_host.py; experiments.lab.front_parts --profile-out): None, or its path
    front_host_profile: str | None = None
    # The engine pair's front posts KV sends during its prefill steps (disaggregation.sends_mid_step),
    # and the simulated prefill replica alike (sim/fleet/front_host.py HandoffHost.sends_mid_step)
    prefill_sends_mid_step: bool = True
    # backend=sim: a prefill replica's steps priced by the receive profile's send-side curve, where it
    # has one (sim/latency/kv_receive.py `send_busy_share_curve`); false: at their price
    kv_send_busy: bool = True

    @property
    def disaggregated(self) -> bool:
        return is_disaggregated(self.roles)


def cluster_config(cfg: DictConfig) -> ClusterConfig:
    """`cfg.cluster`, checked (a config without the group is a one-replica run)."""
    if cfg.get("cluster") is None:
        return ClusterConfig()
    c, d = factory.section(cfg, "cluster"), ClusterConfig()  # d: the defaults, written once
    n = c.get("replicas", d.replicas)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"cluster.replicas={n!r} is invalid: must be an integer >= 1")
    refresh = c.get("refresh_s", d.refresh_s)
    if isinstance(refresh, bool) or not isinstance(refresh, (int, float)) or not 0 <= refresh < inf:
        raise ValueError(f"cluster.refresh_s={refresh!r} is invalid: must be a finite number >= 0 (0: exact)")
    hardware = c.get("hardware")
    if hardware is not None:
        known = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))
        if not isinstance(hardware, list) or len(hardware) != n:
            raise ValueError(f"cluster.hardware={hardware!r} is invalid: give one conf/hardware name per "
                             f"replica ({n}), from {known}, or null")
        for i, name in enumerate(hardware):
            if name not in known:
                raise ValueError(f"cluster.hardware[{i}]={name!r} is unknown: choose one of {known}")
        hardware = tuple(hardware)
    roles = parse_roles(c.get("roles"), n, "cluster.roles")
    decode_router = c.get("decode_router", d.decode_router)
    known_routers = sorted(p.stem for p in (REPO_ROOT / "conf" / "router").glob("*.yaml"))
    if decode_router not in known_routers:
        raise ValueError(f"cluster.decode_router={decode_router!r} is unknown: choose one of {known_routers}")
    link = c.get("link", d.link)
    if not isinstance(link, str) or not link:
        raise ValueError(f"cluster.link={link!r} is invalid: a link name of conf/hardware (nvlink, network)")
    queue, timeout = c.get("handoff_queue", d.handoff_queue), c.get("handoff_timeout_s", d.handoff_timeout_s)
    check_max_queue(queue, "cluster.handoff_queue")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < inf:
        raise ValueError(f"cluster.handoff_timeout_s={timeout!r} is invalid: must be a number of seconds > 0")
    from sim.fleet.disagg import HandoffHost
    host = HandoffHost(c.get("handoff_hop_s", d.handoff_hop_s), c.get("handoff_step_boundaries", d.handoff_step_boundaries),
                       c.get("handoff_host_s", d.handoff_host_s),
                       c.get("prefill_admits_between_steps", d.prefill_admits_between_steps),
                       sends_mid_step=c.get("prefill_sends_mid_step", d.prefill_sends_mid_step))  # checks all five
    batch_blocks = c.get("handoff_batch_blocks", d.handoff_batch_blocks)
    if isinstance(batch_blocks, bool) or not isinstance(batch_blocks, int) or batch_blocks < 1:
        raise ValueError(f"cluster.handoff_batch_blocks={batch_blocks!r} is invalid: must be an integer >= 1")
    receive = c.get("kv_receive_profile", d.kv_receive_profile)
    if receive is not None and (not isinstance(receive, str) or not receive):
        raise ValueError(f"cluster.kv_receive_profile={receive!r} is invalid: null, 'hardware' or a receive "
                         "profile's path (experiments.bench_kv_receive)")
    hop = c.get("dispatch_hop_s", d.dispatch_hop_s)
    if isinstance(hop, bool) or not isinstance(hop, (int, float)) or not 0 <= hop < inf:
        raise ValueError(f"cluster.dispatch_hop_s={hop!r} is invalid: must be a number of seconds >= 0")
    ahead = c.get("prefill_async_scheduling", d.prefill_async_scheduling)
    if not isinstance(ahead, bool):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
            f"cluster.prefill_async_scheduling={ahead!r} is invalid: must be true or false")
    from sim.fleet.front_reads import FrontReadPrice
    reads = FrontReadPrice(c.get("front_token_host_s", d.front_token_host_s),
                           c.get("front_message_host_s", d.front_message_host_s))  # checks both
    front_host = c.get("front_host_profile", d.front_host_profile)
    if front_host is not None and (not isinstance(front_host, str) or not front_host):
        raise ValueError(f"cluster.front_host_profile={front_host!r} is invalid: null or a front host profile's "
                         "path (experiments.lab.front_parts --profile-out)")
    send_busy = c.get("kv_send_busy", d.kv_send_busy)
    if not isinstance(send_busy, bool):
        raise ValueError(f"cluster.kv_send_busy={send_busy!r} is invalid: must be true or false")  # noqa: TRY004
    return ClusterConfig(n, hardware, float(refresh), roles, decode_router, link, queue, float(timeout),
                         float(host.hop_s), host.step_boundaries, float(host.per_handoff_s), batch_blocks, float(hop),
                         ahead, receive, host.admits_between_steps, float(reads.token_s), float(reads.message_s),
                         front_host, host.sends_mid_step, send_busy)


def replica_config(cfg: DictConfig, hardware: str | None) -> DictConfig:
    """The run's config with one replica's hardware."""
    if hardware is None:
        return cfg
    out = cfg.copy()
    OmegaConf.set_struct(out, False)
    out.hardware = OmegaConf.load(HARDWARE_DIR / f"{hardware}.yaml")
    return out


def replica_latency(rcfg: DictConfig, cluster: ClusterConfig, replica: int):
    """Replica `replica`'s latency model, from its config (`replica_config`). With `cluster.hardware`
    its prices follow that replica's GPU (a profile's path is `<gpu>-<model>...csv`), so a GPU the
    latency model has no data for is an error naming `cluster.hardware[replica]`."""
    try:
        return factory.build_latency(rcfg)
    except ValueError as e:
        if cluster.hardware is None:
            raise
        key = f"cluster.hardware[{replica}]={cluster.hardware[replica]!r}"
        path = rcfg.latency.get("path")
        if path is not None and not resolve_path(str(path)).is_file():
            raise ValueError(
                f"{key} has no latency profile: latency={rcfg.latency.get('name')} reads each replica's profile "
                f"for its own GPU, here latency.path={str(path)!r}, which does not exist; use latency=roofline "
                f"(any conf/hardware GPU), profile that GPU (`python -m experiments.profile` on it), or set "
                f"latency.path to one profile for every replica") from None
        raise ValueError(f"{key} (replica {replica}'s GPU): {e}") from None


def prefill_scheduler_config(cfg: DictConfig, cluster: ClusterConfig) -> DictConfig:
    """A prefill replica's scheduler config: it schedules ahead only with
    `cluster.prefill_async_scheduling`, on the engine pair and in the simulator alike (the latency
    model keeps the run's mode: an async profile prices the steps not scheduled ahead from its
    `sync_time_s`, as the synchronous loop pays them)."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(out):
        out.scheduler.async_scheduling = cluster.prefill_async_scheduling
    return out


def build_router(cfg: DictConfig):
    from policies.routing import make_router
    try:
        return make_router(factory.section(cfg, "router"), int(cfg.get("seed") or 0))
    except (TypeError, ValueError) as e:
        raise ValueError(f"router.{e}") from None


def run_fleet(cfg: DictConfig, workload: Workload, on_done: Callable[[int], None], cluster: ClusterConfig):
    """The simulated fleet of the run's `cluster` (its checked `ClusterConfig`, `cluster_config`)."""
    from experiments.lib.backend_run import BackendRun
    from sim.fleet import FleetSimulator, ReplicaSpec
    router = build_router(cfg)
    overhead = ServingOverhead.from_cfg(cfg)
    specs, recorders, info, replica_cfgs = [], [], [], []
    for i in range(cluster.replicas):
        rcfg = replica_config(cfg, cluster.hardware[i] if cluster.hardware else None)
        replica_cfgs.append(rcfg)
        gpu, cpu = factory.kv_block_counts(rcfg)
        recorder = TraceRecorder()
        prefill = cluster.disaggregated and cluster.roles[i] is ReplicaRole.PREFILL
        scheduler = factory.build_scheduler(prefill_scheduler_config(rcfg, cluster) if prefill else rcfg,
                                            gpu, cpu, recorder, workload)
        specs.append(ReplicaSpec(scheduler, replica_latency(rcfg, cluster, i)))
        recorders.append(recorder)
        info.append({"replica": i, "hardware": rcfg.hardware.name, "num_gpu_blocks": gpu, "num_cpu_blocks": cpu})
        if sources := specs[-1].latency.data_sources():
            info[-1]["latency_data"] = sources
    fast_forward = cfg.backend.get("fast_forward", True)
    if cluster.disaggregated:
        from experiments.lib.disagg_backend import disaggregated_fleet
        fleet = disaggregated_fleet(cfg, cluster, replica_cfgs, specs, router, workload, on_done)
    else:
        fleet = FleetSimulator(specs, router, workload.requests, cluster.refresh_s, workload.stop_lens, on_done,
                               fast_forward=fast_forward,
                               dispatch_hop_s=cluster.dispatch_hop_s if cluster.replicas > 1 else 0.0)  # one: no front end
    result = fleet.run()
    for recorder, row, routed, steps in zip(recorders, info, result.num_routed, result.replica_steps):
        overhead.apply(recorder.requests)
        row.update(num_routed=routed, num_steps=steps)
    run_info = {"replicas": cluster.replicas, "router": router.name, "refresh_s": cluster.refresh_s,
                "latency_model": specs[0].latency.name, "replica_info": info}
    if cluster.disaggregated:
        run_info.update(roles=[role.value for role in cluster.roles], decode_router=cluster.decode_router,
                        link=cluster.link, handoffs=len(fleet.handoffs))
        for row, role in zip(info, cluster.roles):
            row["role"] = role.value
    if not overhead.is_zero:
        run_info["serving_overhead"] = overhead.describe()
    return BackendRun(result.num_steps, result.sim_time_s, "simulated", run_info, recorders)
