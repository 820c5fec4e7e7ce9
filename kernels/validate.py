"""Input checks shared by the Triton kernels and the references: a bad call raises ValueError
naming the field, the value and what is allowed.  Only metadata is inspected (no device sync)."""

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(field: str, value: object, allowed: str) -> None:
    raise ValueError(f"{field}={value!r} is invalid: {allowed}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        _fail(
            "k_cache.shape", tuple(k_cache.shape), "expected [num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if v_cache.shape != k_cache.shape:
        _fail("v_cache.shape", tuple(v_cache.shape), f"must equal k_cache.shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in FLOAT_DTYPES:
        _fail(
            "k_cache.dtype/v_cache.dtype",
            (k_cache.dtype, v_cache.dtype),
            f"must be equal and one of {FLOAT_DTYPES}",
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        _fail("cache.stride(-1)", (k_cache.stride(-1), v_cache.stride(-1)), "head_dim must be contiguous")


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
) -> None:
    check_cache(k_cache, v_cache)
    if q.dim() != 3:
        _fail("q.shape", tuple(q.shape), "expected [tokens_or_batch, num_q_heads, head_dim]")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.shape[2] != head_dim:
        _fail("q.shape[2]", q.shape[2], f"must equal the cache head_dim {head_dim}")
    if q.shape[1] % num_kv_heads != 0:
        _fail("q.shape[1]", q.shape[1], f"num_q_heads must be a multiple of num_kv_heads={num_kv_heads}")
    if q.dtype != k_cache.dtype:
        _fail("q.dtype", q.dtype, f"must equal the cache dtype {k_cache.dtype}")
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if context_lens.dim() != 1 or context_lens.dtype != torch.int32:
        _fail("context_lens", (tuple(context_lens.shape), context_lens.dtype), "expected a 1-D int32 tensor")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.shape[0] != num_seqs:
        _fail(
            "block_tables",
            (tuple(block_tables.shape), block_tables.dtype),
            f"expected int32 [num_seqs={num_seqs}, max_blocks]",
        )
    if cu_seqlens_q is None:
        if q.shape[0] != num_seqs:
            _fail("q.shape[0]", q.shape[0], f"decode takes one query per sequence ({num_seqs})")
    elif (
        cu_seqlens_q.dim() != 1 or cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape[0] != num_seqs + 1
    ):
        _fail(
            "cu_seqlens_q",
            (tuple(cu_seqlens_q.shape), cu_seqlens_q.dtype),
            f"expected int32 [num_seqs + 1 = {num_seqs + 1}]",
        )


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The attention output buffer: a new one, or the caller's if it matches q."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        _fail(
            "out",
            (tuple(out.shape), out.dtype, str(out.device)),
            f"expected {tuple(q.shape)} {q.dtype} on {q.device} with contiguous head_dim",
        )
    return out


def check_order(order: torch.Tensor | None, q: torch.Tensor) -> None:
    """A decode launch order: None or [B] int32 on q's device."""
    if order is not None and (order.shape != q.shape[:1] or order.dtype != torch.int32 or order.device != q.device):
        _fail("order", (tuple(order.shape), order.dtype, str(order.device)),
              f"expected ({q.shape[0]},) torch.int32 on {q.device}: a permutation of the batch rows")  # fmt: skip


def check_kv_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_cache(k_cache, v_cache)
    expected = (k.shape[0], *k_cache.shape[2:])
    if k.dim() != 3 or tuple(k.shape) != expected or v.shape != k.shape:
        _fail(
            "k.shape/v.shape",
            (tuple(k.shape), tuple(v.shape)),
            f"expected [num_tokens, num_kv_heads, head_dim] = {expected}",
        )
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        _fail(
            "slot_mapping", (tuple(slot_mapping.shape), slot_mapping.dtype), f"expected int64 [{k.shape[0]}]"
        )


def check_layer_caches(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
    if not k_caches or len(k_caches) != len(v_caches):
        _fail(
            "len(k_caches), len(v_caches)",
            (len(k_caches), len(v_caches)),
            "equal and at least 1 (one per layer)",
        )


def check_swap_lists(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    if not srcs or len(srcs) != len(dsts):
        _fail("srcs/dsts lengths", (len(srcs), len(dsts)), "equal and at least 1")


def check_pairs(pairs: torch.Tensor, same_pool: bool) -> None:
    """pairs [N, 2] int64 of (src, dst) block ids.  Blocks are copied in parallel, so every dst
    must be distinct, and within one pool not also a src; checked when the pairs live on the CPU."""
    if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.dtype != torch.int64:
        _fail("pairs", (tuple(pairs.shape), pairs.dtype), "expected int64 [N, 2] of (src, dst) block ids")
    if pairs.device.type == "cpu" and pairs.shape[0] > 0:
        dst = pairs[:, 1]
        if dst.unique().numel() != dst.numel() or (same_pool and torch.isin(dst, pairs[:, 0]).any()):
            _fail("pairs[:, 1]", dst.tolist(), "destination blocks must be distinct (and not sources)")


def check_stage(caches: list[torch.Tensor], staging: torch.Tensor, block_ids: torch.Tensor) -> None:
    """A staging buffer [len(caches), len(block_ids), *block shape] of the caches' dtype; distinct
    int64 block ids (checked when they live on the CPU)."""
    if not caches:
        _fail("caches", 0, "at least 1 tensor")
    want = (len(caches), block_ids.shape[0], *caches[0].shape[1:])
    if tuple(staging.shape) != want or staging.dtype != caches[0].dtype or not staging.is_contiguous():
        _fail("staging", (tuple(staging.shape), staging.dtype, staging.is_contiguous()),
              f"contiguous {want} {caches[0].dtype}")
    if block_ids.dim() != 1 or block_ids.dtype != torch.int64:
        _fail("block_ids", (tuple(block_ids.shape), block_ids.dtype), "int64 [N]")
    if block_ids.device.type == "cpu" and block_ids.unique().numel() != block_ids.numel():
        _fail("block_ids", block_ids.tolist(), "distinct block ids")
