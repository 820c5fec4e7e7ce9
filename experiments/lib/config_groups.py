"""The keys of the run config's top-level sections and of a fidelity spec, with their types, as
dataclasses (OmegaConf structured configs). The config groups' keys are their plugins' own config
dataclasses, found through the registries (policies/registry.py: CONFIG_GROUPS);
`experiments.lib.config_schema` checks both."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Cluster:
    """conf/cluster/*.yaml: a fleet of replicas behind a router (docs/fleet.md)."""

    replicas: int = 1
    hardware: list[str] | None = None
    refresh_s: float = 0.0
    roles: list[str] | None = None  # prefill | decode | mixed per replica (docs/disaggregation.md)
    decode_router: str = "least_kv"
    link: str = "nvlink"
    handoff_queue: int | None = None  # null: unbounded (backpressure up to handoff_timeout_s)
    handoff_timeout_s: float = 60.0
    handoff_hop_s: float = 1e-4
    handoff_step_boundaries: bool = True
    handoff_host_s: float = 0.0
    handoff_batch_blocks: int = 512
    kv_receive_profile: str | None = None  # backend=sim: what a KV message costs beside the link (null: nothing)
    prefill_admits_between_steps: bool = False  # backend=sim: a synchronous prefill replica's arrivals block it
    front_token_host_s: float = 0.0  # backend=sim: the front's host time per decode output it reads
    front_message_host_s: float = 0.0  # backend=sim: ... and per decode-step message
    front_host_profile: str | None = None  # backend=sim: the front's loop priced from a measured profile
    dispatch_hop_s: float = 6e-4  # backend=sim: arrival -> routed and at its replica (docs/fleet.md)
    prefill_async_scheduling: bool = False  # backend=engine: the pair's prefill engine schedules ahead
    prefill_sends_mid_step: bool = True  # both backends: KV sends posted during a prefill step
    kv_send_busy: bool = True  # backend=sim: prefill steps priced by the receive profile's send-side curve


@dataclass
class Parallel:
    tensor_parallel_size: int = 1
    # The engine's all-reduce paths (EngineArgs' fields of the same names, docs/parallelism.md;
    # None: the engine's default, the symmetric-memory all-reduce on).
    disable_custom_all_reduce: bool | None = None
    custom_all_reduce_one_shot_max_bytes: int | None = None
    custom_all_reduce_max_bytes: int | None = None
    all_reduce_kernel: str | None = None
    # Sequence-parallel steps from this many rows (EngineArgs' field; None or 0: off;
    # latency=operators prices them).
    sequence_parallel_min_rows: int | None = None


@dataclass
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None


@dataclass
class Serving:
    ttft_overhead_s: float = 0.0
    ttft_per_stream_s: float = 0.0
    ttft_jitter_s: list[float] = field(default_factory=list)
    itl_overhead_s: float = 0.0


@dataclass
class Scenario:
    overrides: list[str] = field(default_factory=list)
    load: float | None = None


@dataclass
class GoodputSloEntry:
    ttft_s: float | None = None
    tpot_s: float | None = None
    split_wins: bool | None = None  # the claim checked under this SLO


@dataclass
class GoodputPair:
    split: str = ""  # a prefill/decode split's scenario
    mixed: str = ""  # the co-located replicas' scenario on the same GPUs and stream


@dataclass
class Goodput:
    """A fidelity spec's DistServe comparison (experiments/lib/fidelity_goodput.py)."""

    margin: float = 0.05
    slos: dict[str, GoodputSloEntry] = field(default_factory=dict)
    comparisons: dict[str, GoodputPair] = field(default_factory=dict)


@dataclass
class FidelitySpec:
    extends: str | None = None  # a spec (path relative to this file) whose keys this one replaces
    profile: str | None = None  # the simulator's profile unless --profile (None: the sim config's latency.path)
    common: list[str] = field(default_factory=list)
    engine: list[str] = field(default_factory=list)
    sim: list[str] = field(default_factory=list)
    warmup: list[str] = field(default_factory=list)
    capacity: str | None = None
    scenarios: dict[str, Scenario] = field(default_factory=dict)
    ab: list[Any] = field(default_factory=list)
    goodput: Goodput | None = None
