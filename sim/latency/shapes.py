"""Model and hardware descriptions the latency models compute with.

`ModelShape.from_dict` accepts a `conf/model/*.yaml` mapping or a transformers config's `to_dict()`
(same key names); `Hardware.from_dict` a `conf/hardware/*.yaml` mapping. Byte and FLOP counts here
are per forward step and follow the Llama-family layout (fused or not, the bytes are the same).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def _require(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{where}.{key} is missing: the latency model needs it")
    return cfg[key]


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name}={value!r} is invalid: must be a number > 0")
    return value


@dataclass(slots=True, frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype_bytes: int

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], where: str = "model") -> ModelShape:
        hidden = _require(cfg, "hidden_size", where)
        heads = _require(cfg, "num_attention_heads", where)
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").replace("torch.", "")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{where}.dtype={dtype!r} is invalid: choose one of {sorted(DTYPE_BYTES)}")
        shape = cls(
            name=str(cfg.get("name") or cfg.get("_name_or_path") or cfg.get("model_type") or "model"),
            hidden_size=hidden,
            intermediate_size=_require(cfg, "intermediate_size", where),
            num_layers=_require(cfg, "num_hidden_layers", where),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab_size=_require(cfg, "vocab_size", where),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            dtype_bytes=DTYPE_BYTES[dtype],
        )
        for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size"):
            _positive(getattr(shape, f), f"{where}.{f}")
        return shape

    @property
    def linear_params_per_layer(self) -> int:
        """q, k, v, o projections (+ qkv bias) and the gated MLP (gate, up, down)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.attention_bias else 0
        return h * (q + 2 * kv) + bias + q * h + 3 * h * self.intermediate_size

    @property
    def linear_params(self) -> int:
        """Parameters touched by every token's GEMMs (all decoder layers, not the LM head)."""
        return self.num_layers * self.linear_params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters (norm weights included); the LM head counts once when tied."""
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.linear_params + norms + embed

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def step_weight_bytes(self) -> int:
        """Weights one forward step streams from HBM: every layer plus the LM head (the embedding
        table is only gathered row by row, so it is not read whole unless tied to the head)."""
        return (self.linear_params + self.lm_head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def activation_bytes_per_token(self) -> int:
        """HBM traffic of the elementwise kernels per token and layer summed over layers: norms,
        residual adds, RoPE, SiLU-and-mul and the GEMM inputs/outputs, ~ (8 h + 5 i) elements."""
        return self.num_layers * (8 * self.hidden_size + 5 * self.intermediate_size) * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query token, key token) pair over all layers: QK^T and PV, 2 per MAC."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


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

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], where: str = "hardware") -> Hardware:
        optional = ("interconnect_bandwidth", "interconnect_latency_s")
        values = {f.name: cfg.get(f.name) if f.name in optional else _require(cfg, f.name, where)
                  for f in fields(cls)}
        for f in fields(cls):
            if f.name == "name" or (f.name in optional and values[f.name] is None):
                continue
            v = values[f.name]
            if f.name in ("step_overhead_s", "swap_latency_s", "swap_block_overhead_s", "interconnect_latency_s"):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                    raise ValueError(f"{where}.{f.name}={v!r} is invalid: must be a number >= 0")
            elif f.name.endswith("efficiency"):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                    raise ValueError(f"{where}.{f.name}={v!r} is invalid: must be in (0, 1]")
            else:
                _positive(v, f"{where}.{f.name}")
        return cls(**values)

    def flops_for(self, dtype_bytes: int) -> float:
        return self.fp32_flops if dtype_bytes >= 4 else self.bf16_flops

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30
