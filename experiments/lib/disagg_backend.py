"""backend=sim with `cluster.roles` holding prefill and decode replicas: the disaggregated fleet
(sim/fleet/disagg.py) built from the config (docs/disaggregation.md).

Each prefill replica sends its KV over `cluster.link` of its own hardware file (`links.<name>`:
bandwidth and latency), and a block's bytes per tensor-parallel rank come from the model's shape
(policies/disagg/handoff.py: `kv_block_bytes`). The decode router is the conf/router file
`cluster.decode_router` names, seeded by the run's seed + 1 (the first router takes the seed).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.lib import factory
from experiments.lib.paths import REPO_ROOT
from experiments.lib.workloads import Workload
from experiments.lib.workloads.base import READ_OUTPUT_KIND
from policies.disagg import ReplicaRole, kv_block_bytes
from sim.fleet.disagg import DisaggFleetSimulator
from sim.fleet.front_host import FrontHostProfile, HandoffHost
from sim.fleet.front_reads import FrontReadPrice
from sim.latency.kv_receive import HARDWARE, KVReceivePrice, load_kv_receive

ROUTER_DIR = REPO_ROOT / "conf" / "router"


def decode_router(cfg: DictConfig, name: str):
    from policies.routing import make_router
    section = OmegaConf.to_container(OmegaConf.load(ROUTER_DIR / f"{name}.yaml"), resolve=True)
    try:
        return make_router(section, int(cfg.get("seed") or 0) + 1)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cluster.decode_router: {e}") from None


def receive_price(cluster, replica_cfgs: list[DictConfig]) -> KVReceivePrice | None:
    """`cluster.kv_receive_profile`: a relative path is the repository's; 'hardware' prices the
    scatter at the first decode replica's copy rate."""
    setting = cluster.kv_receive_profile
    if setting is not None and setting != HARDWARE and not Path(setting).is_absolute():
        setting = str(REPO_ROOT / setting)
    decode = next(r for role, r in zip(cluster.roles, replica_cfgs) if role is ReplicaRole.DECODE)
    price = load_kv_receive(setting, factory.hardware(decode).hbm_bandwidth)
    model = str(decode.model.name)
    if price is not None and price.model is not None and price.model != model:  # it prices its own model
        raise ValueError(f"cluster.kv_receive_profile={setting!r} was measured on model {price.model!r}, and this "
                         f"run's decode replicas run {model!r}: measure one for it (`python -m "
                         f"experiments.bench_kv_receive --model {model} --out ...` on two GPUs) or use 'hardware'")
    if price is not None and not cluster.kv_send_busy:  # the prefill replicas' steps at their price
        price = dataclasses.replace(price, send_busy_share_at=(), send_busy_factor_at=())
    return price


def front_host(cluster, replica_cfgs: list[DictConfig]) -> tuple[HandoffHost, FrontReadPrice]:
    """The host loops' prices: `cluster.front_host_profile`'s units where one is given (a relative
    path is the repository's; a profile of another model is refused), else the cluster's own keys."""
    setting = cluster.front_host_profile
    if setting is None:
        return (HandoffHost(cluster.handoff_hop_s, cluster.handoff_step_boundaries, cluster.handoff_host_s,
                            cluster.prefill_admits_between_steps, sends_mid_step=cluster.prefill_sends_mid_step),
                FrontReadPrice(cluster.front_token_host_s, cluster.front_message_host_s))
    path = Path(setting) if Path(setting).is_absolute() else REPO_ROOT / setting
    profile = FrontHostProfile.read(path)
    prefill = next(r for role, r in zip(cluster.roles, replica_cfgs) if role is ReplicaRole.PREFILL)
    model = str(prefill.model.name)
    if profile.model is not None and profile.model != model:
        raise ValueError(f"cluster.front_host_profile={setting!r} was measured on model {profile.model!r}, and this "
                         f"run's prefill replicas run {model!r}: measure one for it (`python -m "
                         "experiments.lab.front_parts --profile-out ...` on two GPUs) or set it to null")
    return (HandoffHost.from_profile(profile, cluster.handoff_hop_s, cluster.handoff_step_boundaries,
                                     cluster.prefill_sends_mid_step),
            FrontReadPrice(cluster.front_token_host_s, profile.read_message_s))


def disaggregated_fleet(cfg: DictConfig, cluster, replica_cfgs: list[DictConfig], specs: list, router,
                        workload: Workload, on_done: Callable[[int], None]) -> DisaggFleetSimulator:
    """`cluster`: the run's checked `ClusterConfig` (fleet_backend.py); `replica_cfgs`: each replica's
    config (its own hardware)."""
    host, reads = front_host(cluster, replica_cfgs)
    links, block_bytes = [], []
    for role, rcfg in zip(cluster.roles, replica_cfgs):
        if role is ReplicaRole.PREFILL:
            links.append(factory.hardware(rcfg).link(cluster.link, "cluster.link"))
            block_bytes.append(kv_block_bytes(factory.model_shape(rcfg), factory.block_size(rcfg),
                                              factory.tensor_parallel_size(rcfg)))
        else:
            links.append(None)
            block_bytes.append(0)
    return DisaggFleetSimulator(specs, cluster.roles, router, decode_router(cfg, cluster.decode_router),
                                workload.requests, links, block_bytes, cluster.handoff_queue,
                                cluster.handoff_timeout_s, cluster.refresh_s, workload.stop_lens, on_done,
                                fast_forward=cfg.backend.get("fast_forward", True),
                                host=host, batch_blocks=cluster.handoff_batch_blocks,
                                receive=receive_price(cluster, replica_cfgs), front_reads=reads,
                                final_outputs_only=READ_OUTPUT_KIND == "final_only")
