"""Model and hardware descriptions the latency models compute with: the model's is the one shared
with the engine (policies/model_shape.py); `Hardware.from_dict` reads a `conf/hardware/*.yaml` mapping.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from policies.model_shape import DTYPE_BYTES, ModelShape, _require

__all__ = ["DTYPE_BYTES", "Hardware", "Link", "ModelShape"]


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r} is invalid: must be a finite number > 0")
    return value


def _non_negative(value: Any) -> bool:
    """A finite number >= 0 (NaN and infinity would make every price NaN or infinite)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < math.inf


@dataclass(slots=True)
class Link:
    """A GPU-to-GPU path a KV transfer takes (conf/hardware `links.<name>`), per GPU and each way.
    A transfer costs `latency_s` (the wire's set-up) + `overhead_s` (the sending and receiving
    software's fixed cost per message: gathering and scattering the blocks, the send/recv calls,
    noticing completion; measured by experiments/bench_kv_transfer.py) + bytes / bandwidth."""

    bandwidth_gb_s: float  # GB/s (1e9 B/s)
    latency_s: float  # per transfer
    overhead_s: float = 0.0  # per transfer (one message), the engine's fixed cost beside the wire's

    def transfer_time(self, num_bytes: int) -> float:
        return self.latency_s + self.overhead_s + num_bytes / (self.bandwidth_gb_s * 1e9)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], where: str) -> Link:
        if not isinstance(cfg, Mapping):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                f"{where}={cfg!r} is invalid: a mapping with bandwidth_gb_s, latency_s (and optional overhead_s)")
        unknown = sorted(set(cfg) - {"bandwidth_gb_s", "latency_s", "overhead_s"})
        if unknown:
            raise ValueError(f"{where} keys {unknown} are unknown: allowed are bandwidth_gb_s, latency_s, overhead_s")
        bw, lat, over = cfg.get("bandwidth_gb_s"), cfg.get("latency_s"), cfg.get("overhead_s", 0.0)
        _positive(bw, f"{where}.bandwidth_gb_s")
        for name, value in (("latency_s", lat), ("overhead_s", over)):
            if not _non_negative(value):
                raise ValueError(f"{where}.{name}={value!r} is invalid: must be a finite number >= 0 (seconds)")
        return cls(float(bw), float(lat), float(over))


@dataclass(slots=True, frozen=True)
class Hardware:
    name: str
    memory_gib: float
    hbm_bandwidth: float  # B/s, measured device-to-device copy bandwidth
    bf16_flops: float  # FLOP/s, dense bf16/fp16 matmul
    fp32_flops: float  # FLOP/s, used when the model runs in fp32
    host_link_bandwidth: float  # B/s, pinned host <-> GPU, one direction
    bandwidth_efficiency: float  # fraction of hbm_bandwidth real kernels reach
    gemm_efficiency: float  # fraction of peak FLOP/s the model's GEMMs reach
    attention_efficiency: float  # fraction of peak FLOP/s the attention kernels reach
    step_overhead_s: float  # fixed per step: launch, Python scheduling, sampling
    swap_latency_s: float  # fixed per swap batch (stream sync, launch)
    swap_block_overhead_s: float  # per block moved: one copy per layer and K/V; small blocks pay it more
    # GPU-to-GPU link (tensor parallelism; optional, needed only for tensor_parallel_size > 1).
    interconnect_bandwidth: float | None = None  # B/s per GPU, each way
    interconnect_latency_s: float | None = None  # per collective
    # KV-transfer paths between replicas (prefill/decode disaggregation): name -> Link, e.g. nvlink
    # (GPUs of one host) and network (GPUs of different hosts); `cluster.link` picks one.
    links: dict[str, Link] | None = None
    # B/s at which decode attention re-reads a KV block that another sequence of the same batch read
    # from HBM (a shared prefix: served from L2); None: re-reads priced as fresh HBM reads.
    l2_bandwidth: float | None = None

    @property
    def kv_reread_cost(self) -> float:
        """The cost of re-reading a shared KV block as a fraction of a fresh read's: hbm_bandwidth /
        l2_bandwidth (at most 1), 1.0 without an `l2_bandwidth`."""
        if self.l2_bandwidth is None:
            return 1.0
        return min(1.0, self.hbm_bandwidth / self.l2_bandwidth)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], where: str = "hardware") -> Hardware:
        if not isinstance(cfg, Mapping):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                f"{where}={cfg!r} is invalid: a mapping of conf/hardware keys (e.g. yaml.safe_load of "
                "conf/hardware/h200.yaml)")
        optional = ("interconnect_bandwidth", "interconnect_latency_s", "links", "l2_bandwidth")
        values = {f.name: cfg.get(f.name) if f.name in optional else _require(cfg, f.name, where)
                  for f in fields(cls)}
        for f in fields(cls):
            if f.name == "name" or (f.name in optional and values[f.name] is None):
                continue
            if f.name == "links":
                if not isinstance(values["links"], Mapping):
                    raise ValueError(f"{where}.links={values['links']!r} is invalid: a mapping of link name -> "
                                     "{bandwidth_gb_s, latency_s}")
                values["links"] = {str(k): Link.from_dict(v, f"{where}.links.{k}") for k, v in values["links"].items()}
                continue
            v = values[f.name]
            if f.name in ("step_overhead_s", "swap_latency_s", "swap_block_overhead_s", "interconnect_latency_s"):
                if not _non_negative(v):
                    raise ValueError(f"{where}.{f.name}={v!r} is invalid: must be a finite number >= 0")
            elif f.name.endswith("efficiency"):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                    raise ValueError(f"{where}.{f.name}={v!r} is invalid: must be in (0, 1]")
            else:
                _positive(v, f"{where}.{f.name}")
        return cls(**values)

    def link(self, name: str, key: str = "cluster.link") -> Link:
        """The named KV-transfer link; ValueError naming `key` when this hardware does not have it."""
        links = self.links or {}
        if name not in links:
            raise ValueError(f"{key}={name!r} is not a link of hardware {self.name!r}: conf/hardware/{self.name}.yaml "
                             f"has links {sorted(links)} (add links.{name}: {{bandwidth_gb_s, latency_s}})")
        return links[name]

    def flops_for(self, dtype_bytes: int) -> float:
        return self.fp32_flops if dtype_bytes >= 4 else self.bf16_flops

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30
