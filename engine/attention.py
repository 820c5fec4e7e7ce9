"""Paged attention for one step's flattened varlen batch: the prefill part (sequences computing
more than one token) comes first, the decode part (one token each) after it.

Every new token's K/V is written to the cache through `slot_mapping`, then the prefill part runs
`paged_prefill_attention` and the decode part `paged_decode_attention`, both reading K/V from the
cache. `ops` is `kernels` (Triton) or `kernels.reference` (plain torch, the default on CPU).
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

ATTENTION_BACKENDS = ("auto", "triton", "reference")


def attention_ops(backend: str, device: torch.device) -> ModuleType | SimpleNamespace:
    """"auto": `kernels` (Triton on CUDA tensors, references on CPU ones); "triton": the Triton
    launchers whatever the device (interpreted on CPU under TRITON_INTERPRET=1); "reference"."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is invalid: one of {ATTENTION_BACKENDS}")
    if backend == "auto":
        return importlib.import_module("kernels" if device.type == "cuda" else "kernels.reference")
    if backend == "reference":
        return importlib.import_module("kernels.reference")
    from kernels import cache_write, copy, decode, prefill

    return SimpleNamespace(paged_decode_attention=decode.paged_decode_attention,
                           paged_prefill_attention=prefill.paged_prefill_attention,
                           write_kv_cache=cache_write.write_kv_cache, copy_blocks=copy.copy_blocks,
                           swap_blocks=copy.swap_blocks)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not write (CUDA-graph padding)
    num_prefill_tokens: int
    # Prefill part: S sequences, tokens [0, num_prefill_tokens) of the batch.
    prefill_block_tables: torch.Tensor | None = None  # [S, W] int32
    prefill_cu_seqlens_q: torch.Tensor | None = None  # [S + 1] int32
    prefill_context_lens: torch.Tensor | None = None  # [S] int32
    prefill_max_seqlen_q: int = 0
    # Decode part: B sequences, tokens [num_prefill_tokens, num_prefill_tokens + B).
    decode_block_tables: torch.Tensor | None = None  # [B, W] int32
    decode_context_lens: torch.Tensor | None = None  # [B] int32 (0 = padding row)


class PagedAttention:
    """Attention of one layer over its K/V cache; caches are bound once the KV cache exists."""

    def __init__(self, ops: ModuleType, layer_idx: int, scale: float) -> None:
        self.ops = ops
        self.layer_idx = layer_idx
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self._pass_max_seqlen = "max_seqlen_q" in inspect.signature(ops.paged_prefill_attention).parameters

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        if self.k_cache is None:
            raise RuntimeError(f"layer {self.layer_idx}: no KV cache bound (call bind_kv_cache first)")
        self.ops.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        n_pre = meta.num_prefill_tokens
        if n_pre == q.shape[0]:
            return self._prefill(q, meta)
        if n_pre == 0:
            return self._decode(q, meta)
        return torch.cat([self._prefill(q[:n_pre], meta), self._decode(q[n_pre:], meta)])

    def _prefill(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        kw = {"max_seqlen_q": meta.prefill_max_seqlen_q} if self._pass_max_seqlen else {}
        return self.ops.paged_prefill_attention(
            q, self.k_cache, self.v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens, self.scale, **kw)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.ops.paged_decode_attention(
            q, self.k_cache, self.v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale)
