"""Paged attention for one step's flattened varlen batch: the decode rows (one query each) come
first, the prefill sequences' rows (sequences computing more than one token) after them.

Every new token's K/V is written to the cache through `slot_mapping`, then the decode rows run
`paged_decode_attention` and the prefill sequences `paged_prefill_attention`, both reading K/V from
the cache. `ops` is the Triton launchers (CUDA) or `kernels.reference` (plain torch, the CPU path).
The layout is the same in eager steps and in CUDA graphs; a graph pads it to its bucket: decode
rows whose context length is 0 are idle (their output is overwritten by the prefill rows they
overlap, or belongs to a padding row), and the prefill kernel runs a fixed tile-map grid.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

ATTENTION_BACKENDS = ("auto", "triton", "reference")
DECODE_KERNELS = ("auto", "per-head", "packed", "tma")
# The engine default, resolved when the runner is built (`resolve_decode_kernel`): the Gluon TMA
# kernel, launched longest first, on Hopper with fp16/bf16 (4.6% more output tokens/s than packed on
# nano-vllm's benchmark: docs/kernels.md), the packed kernel elsewhere (faster than per-head on the
# ragged batches an engine runs and from ~8k tokens per sequence).
DEFAULT_DECODE_KERNEL = "auto"
# The Gluon kernel's page boxes: a step of 32 tokens covers one, two or four whole blocks.
_TMA_TILE_TOKENS = 32


def resolve_decode_kernel(decode_kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                          group: int, block_size: int) -> str:
    """The decode kernel an engine runs: "auto" -> "tma" on a compute capability 9.x GPU with a
    float16/bfloat16 model whose shapes the Gluon kernel takes (head_dim 64 or 128, at most 16 query
    heads per KV head, 32 tokens = 1, 2 or 4 blocks), else "packed"; any other name is kept."""
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel={decode_kernel!r} is invalid: one of {DECODE_KERNELS}")
    if decode_kernel != "auto":
        return decode_kernel
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    fits = (dtype in (torch.float16, torch.bfloat16) and head_dim in (64, 128) and group <= 16
            and _TMA_TILE_TOKENS % block_size == 0 and _TMA_TILE_TOKENS // block_size in (1, 2, 4))
    return "tma" if hopper and fits else "packed"


def attention_ops(backend: str, device: torch.device, decode_kernel: str = "packed") -> ModuleType | SimpleNamespace:
    """"auto": the Triton launchers on CUDA (unless `kernels.BACKEND` forces the references), the
    references on CPU; "triton": the Triton launchers whatever the device (interpreted on CPU under
    TRITON_INTERPRET=1); "reference": `kernels.reference`. `decode_kernel` picks the Triton decode
    kernel: "per-head" (kernels/decode.py), "packed" (kernels/decode_packed.py, all KV heads of a
    block per tile, work split evenly over the batch's tokens) or "tma" (kernels/decode_tma.py, Gluon
    TMA page loads; Hopper+); "auto" is resolved first (`resolve_decode_kernel`)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is invalid: one of {ATTENTION_BACKENDS}")
    if decode_kernel not in DECODE_KERNELS or decode_kernel == "auto":
        allowed = tuple(k for k in DECODE_KERNELS if k != "auto")
        raise ValueError(f"decode_kernel={decode_kernel!r} is invalid here: one of {allowed} (resolve \"auto\" "
                         "with resolve_decode_kernel)")
    if backend == "auto":
        import kernels  # its BACKEND (env SERVELAB_KERNELS) may force the references

        backend = "triton" if device.type == "cuda" and kernels.BACKEND != "reference" else "reference"
    if backend == "reference":
        return importlib.import_module("kernels.reference")
    from kernels import cache_write, copy, decode, prefill, qk_rope_cache
    from kernels.decode_packed import PackedDecodeConfig
    from kernels.decode_tma import TmaDecodeConfig

    decode_fn = decode.paged_decode_attention
    if decode_kernel == "packed":
        decode_fn = functools.partial(decode.paged_decode_attention, config=PackedDecodeConfig())
    elif decode_kernel == "tma":  # the per-head kernel where the Gluon one cannot run (CPU, fp32)
        decode_fn = functools.partial(decode.paged_decode_attention, config=TmaDecodeConfig())
    return SimpleNamespace(paged_decode_attention=decode_fn,
                           paged_prefill_attention=prefill.paged_prefill_attention,
                           write_kv_cache=cache_write.write_kv_cache,
                           qk_norm_rope_write=qk_rope_cache.qk_norm_rope_write, copy_blocks=copy.copy_blocks,
                           swap_blocks=copy.swap_blocks, swap_layers=copy.swap_layers)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not write (padding)
    # Decode part: rows [0, D) of the batch, one query each.
    num_decode_rows: int  # D
    decode_block_tables: torch.Tensor | None = None  # [D, W] int32
    decode_context_lens: torch.Tensor | None = None  # [D] int32 (0 = idle row)
    decode_order: torch.Tensor | None = None  # [D] int32: the rows longest context first (launch order)
    # Prefill part (absent in decode-only steps): S sequences, rows from cu_seqlens_q[0] on.
    prefill_block_tables: torch.Tensor | None = None  # [S, W] int32
    prefill_cu_seqlens_q: torch.Tensor | None = None  # [S + 1] int32, batch rows
    prefill_context_lens: torch.Tensor | None = None  # [S] int32
    prefill_max_seqlen_q: int = 0  # sizes the eager grid
    prefill_tiles: torch.Tensor | None = None  # [N, 2] int32 tile map: a fixed grid (CUDA graphs)


class PagedAttention:
    """Attention of one layer over its K/V cache; caches are bound once the KV cache exists."""

    def __init__(self, ops: ModuleType, layer_idx: int, scale: float) -> None:
        self.ops = ops
        self.layer_idx = layer_idx
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # The Triton launchers write both parts into one output buffer and take a launch order; the
        # references return theirs and launch nothing.
        params = inspect.signature(ops.paged_decode_attention).parameters
        self._write_out = "out" in params
        self._takes_order = "order" in params

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]: writes k/v to the cache, then `attend`."""
        self.ops.write_kv_cache(k, v, *self.caches(), meta.slot_mapping)
        return self.attend(q, meta)

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V caches (bound once the KV cache exists)."""
        if self.k_cache is None:
            raise RuntimeError(f"layer {self.layer_idx}: no KV cache bound (call bind_kv_cache first)")
        return self.k_cache, self.v_cache

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq, D], over K/V already in the cache (this step's included: written
        through `caches()`)."""
        d = meta.num_decode_rows
        if meta.prefill_cu_seqlens_q is None:
            return self._decode(q, meta)
        if not self._write_out:
            out = self._prefill(q, meta)  # zero on the decode rows
            if d:
                out[:d] = self._decode(q[:d], meta)
            return out
        out = torch.empty_like(q)
        if d:
            self._decode(q[:d], meta, out=out[:d])
        return self._prefill(q, meta, out=out)  # after the decode part: it owns the rows they share

    def _prefill(self, q: torch.Tensor, meta: AttentionMetadata, **out) -> torch.Tensor:
        if meta.prefill_tiles is not None:
            out["tiles"] = meta.prefill_tiles
        return self.ops.paged_prefill_attention(
            q, self.k_cache, self.v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens, self.scale, meta.prefill_max_seqlen_q, **out)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, **out) -> torch.Tensor:
        if self._takes_order:
            out["order"] = meta.decode_order
        return self.ops.paged_decode_attention(
            q, self.k_cache, self.v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale,
            **out)
