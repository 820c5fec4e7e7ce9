"""The keys each config group and top-level section may hold, with their types, as dataclasses
(OmegaConf structured configs): one per group kind (workload kinds, backends, latency models),
plus the top-level sections and a fidelity spec. `experiments.lib.config_schema` picks the one a
section must follow and refuses unknown or mistyped keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LengthDist:
    dist: str | None = None  # fixed | uniform | lognormal
    value: int | None = None  # fixed
    low: int | None = None  # uniform
    high: int | None = None
    mean: float | None = None  # lognormal
    sigma: float | None = None
    min: int | None = None
    max: int | None = None


@dataclass
class PriorityClasses:
    values: list[int] = field(default_factory=list)
    weights: list[float] | None = None


@dataclass
class Tenants:
    names: list[str] = field(default_factory=list)
    rates: list[float] | None = None
    num_requests: list[int] | None = None


@dataclass
class SystemPromptsSpec:
    num: int | None = None
    len: int | None = None
    zipf: float | None = None


@dataclass
class SyntheticWorkload:
    name: str | None = None
    kind: str = "synthetic"
    num_requests: int | None = None
    arrival: str | None = None
    rate: float | None = None
    burstiness: float | None = None
    prompt_len: LengthDist | None = None
    output_len: LengthDist | None = None
    max_tokens: int | None = None
    priority: PriorityClasses | None = None
    shared_prefix_len: int | None = None
    vocab_size: int | None = None
    seed: int | None = None
    length_correlation: float | None = None
    tenants: Tenants | None = None
    system_prompts: SystemPromptsSpec | None = None


@dataclass
class SessionsWorkload:
    name: str | None = None
    kind: str = "sessions"
    num_sessions: int | None = None
    num_requests: int | None = None
    rate: float | None = None
    turns: LengthDist | None = None
    think_time_s: float | None = None
    prompt_len: LengthDist | None = None
    output_len: LengthDist | None = None
    max_prompt_len: int | None = None
    max_tokens: int | None = None
    system_prompts: SystemPromptsSpec | None = None
    vocab_size: int | None = None
    seed: int | None = None


@dataclass
class AzureWorkload:
    name: str | None = None
    kind: str = "azure"
    path: str | None = None
    num_requests: int | None = None
    time_scale: float | None = None
    drop_empty: bool = False
    seed: int | None = None


@dataclass
class BurstgptWorkload(AzureWorkload):
    kind: str = "burstgpt"
    model: str | None = None
    log_type: str | None = None


@dataclass
class MooncakeWorkload(AzureWorkload):
    kind: str = "mooncake"
    block_tokens: int | None = None


@dataclass
class NanovllmWorkload:
    name: str | None = None
    kind: str = "nanovllm"
    num_requests: int | None = None
    max_input_len: int | None = None
    max_output_len: int | None = None
    rate: float | None = None
    seed: int | None = None


@dataclass
class ReplayWorkload:
    name: str | None = None
    kind: str = "replay"
    path: str | None = None
    num_requests: int | None = None
    time_scale: float | None = None
    rate: float | None = None
    seed: int | None = None


@dataclass
class Blocks:
    kind: str | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float | None = None
    num_cpu_blocks: int | None = None
    swap_space_gib: float | None = None
    watermark: float | None = None


@dataclass
class SimBackend:
    name: str = "sim"
    fast_forward: bool = True


@dataclass
class EngineBackend:
    name: str = "engine"
    device: str | None = None
    dtype: str | None = None
    weights: str | None = None
    enforce_eager: bool = False
    decode_kernel: str | None = None


@dataclass
class ServerBackend:
    name: str = "server"
    url: str | None = None
    model: str | None = None
    max_concurrency: int | None = None
    max_request_rate: float | None = None
    timeout_s: float | None = None


@dataclass
class RooflineLatency:
    name: str = "roofline"


@dataclass
class ProfiledLatency:
    name: str = "profiled"
    path: str | None = None


@dataclass
class OperatorsLatency:
    name: str = "operators"
    dir: str | None = None
    gpu: str | None = None
    dtype: str | None = None
    kernels: str = "auto"
    cuda_graphs: bool = True
    host_step_s: float = 0.0
    sync_host_s: float = 0.0
    sync_host_per_seq_s: float = 0.0
    admission_s: float = 0.0


@dataclass
class Model:
    """conf/model/*.yaml: engine.config.ModelConfig's yaml fields (that module imports torch)."""

    name: str | None = None
    architecture: str | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float | None = None
    tie_word_embeddings: bool | None = None
    attention_bias: bool | None = None
    dtype: str | None = None
    weights: str | None = None


@dataclass
class Cluster:
    replicas: int = 1
    hardware: list[str] | None = None
    refresh_s: float = 0.0


@dataclass
class Parallel:
    tensor_parallel_size: int = 1


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
