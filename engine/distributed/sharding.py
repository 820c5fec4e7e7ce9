"""Which part of the model one tensor-parallel rank holds (Megatron-style, as vLLM shards it).

- Attention: q heads split evenly; KV heads split evenly when there are at least as many as ranks,
  else replicated (each rank holds the one KV head its q heads read). q/k/v (and their biases)
  are column-parallel; o_proj is row-parallel (partial sums all-reduced, its bias added once).
- MLP: gate/up column-parallel by intermediate size; down_proj row-parallel.
- Embedding and LM head: vocab-parallel, `ceil(vocab / N)` rows per rank (the last rank's tail is
  zero padding whose logits are dropped when the shards are gathered).
- Norms (and Qwen3's per-head q/k norms) are replicated.

`TPShard.of(cfg, rank, size)` refuses a size that does not divide a sharded dimension, naming the
field. `local_config` is the model as one rank sees it (its heads and intermediate size): the KV
cache, its block bytes and the attention kernels' tiling are sized from it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from policies.tensor_parallel import TPSplit, tp_split


@dataclass(slots=True, frozen=True)
class TPShard:
    rank: int
    size: int
    num_heads: int  # q heads on this rank
    head_start: int  # first q head of this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_head_start: int
    intermediate: int  # MLP columns on this rank
    vocab: int  # embedding / LM-head rows on this rank (padded: the same on every rank)
    vocab_size: int  # the model's real vocabulary

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> TPShard:
        split = check_divisible(cfg, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} is invalid: must be in [0, {size})")
        kv = cfg.num_key_value_heads
        # Replicated KV heads: ranks [i * size / kv, (i + 1) * size / kv) share KV head i.
        kv_start = rank * split.num_kv_heads if kv >= size else rank * kv // size
        return cls(rank, size, split.num_heads, rank * split.num_heads, split.num_kv_heads, kv_start,
                   split.intermediate_size, split.vocab_size, cfg.vocab_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with this rank's heads and intermediate size (vocabulary and hidden size whole)."""
        return dataclasses.replace(cfg, num_attention_heads=self.num_heads,
                                   num_key_value_heads=self.num_kv_heads, intermediate_size=self.intermediate)

    def source_rows(self, cfg: ModelConfig, param: str, part: str | None) -> tuple[int, int, int, int] | None:
        """(dim, start, length, full length) of the part of a full checkpoint tensor this rank holds,
        for our parameter `param` (e.g. "layers.0.self_attn.qkv_proj.weight") and fused part ("q",
        "gate", ...); None: the whole tensor (replicated)."""
        module, kind = param.split(".")[-2:] if "." in param else ("", param)
        d = cfg.head_dim
        if module == "qkv_proj":
            if part == "q":
                return 0, self.head_start * d, self.num_heads * d, cfg.num_attention_heads * d
            return 0, self.kv_head_start * d, self.num_kv_heads * d, cfg.num_key_value_heads * d
        if module == "gate_up_proj":
            return 0, self.rank * self.intermediate, self.intermediate, cfg.intermediate_size
        if module == "o_proj" and kind == "weight":
            return 1, self.head_start * d, self.num_heads * d, cfg.num_attention_heads * d
        if module == "down_proj":
            return 1, self.rank * self.intermediate, self.intermediate, cfg.intermediate_size
        if module in ("embed_tokens", "lm_head"):
            start = min(self.vocab_start, self.vocab_size)
            return 0, start, min(self.vocab, self.vocab_size - start), self.vocab_size
        return None

    def take(self, cfg: ModelConfig, param: str, part: str | None, tensor: torch.Tensor, dst: torch.Tensor,
             hf_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's part of the full checkpoint `tensor`, the part of `dst` it fills: all of it
        but the vocabulary padding)."""
        rows = self.source_rows(cfg, param, part)
        if rows is None:
            return tensor, dst
        dim, start, length, full = rows
        if tensor.dim() <= dim or tensor.shape[dim] != full:
            raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, the model expects {full} "
                             f"along dim {dim}: the checkpoint does not match the config")
        return tensor.narrow(dim, start, length), dst.narrow(dim, 0, length)


def check_divisible(cfg: ModelConfig, size: int) -> TPSplit:
    """ValueError naming the first field that `size` ranks cannot split (policies/tensor_parallel.py)."""
    return tp_split(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size,
                    size, cfg.name)
