"""The hand-off of one request from a prefill replica to a decode replica (`KVHandoff`), and the
size of its KV transfer from the model's shape.

A request is handed off once its prompt is computed and its first token sampled on the prefill
side (vLLM's and SGLang's disaggregated modes do the same). What moves is the KV of its
`num_computed_tokens` prompt positions: `num_blocks` blocks, each holding, per tensor-parallel rank,
`block_size` tokens x 2 (K and V) x the rank's KV heads x head_dim x the KV dtype's bytes, for each
layer (`kv_block_bytes`). Every rank of the prefill replica sends its own shard to the matching rank
of the decode replica, in parallel, so `num_bytes` is what one rank sends; it prices the transfer.

Timestamps are on the backend's clock (simulated or wall), set as the hand-off moves:
prefill_end_time (first token sampled) -> reserved_time (decode blocks allocated) ->
transfer_start_time -> transfer_end_time (the decode side has the KV: the first token reaches the
user then, so TTFT = queueing + prefill + transfer).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.model_shape import ModelShape
from policies.request import Request
from policies.tensor_parallel import tp_split

# Request-row columns a disaggregated run adds (docs/disaggregation.md); mixed replicas leave them empty.
HANDOFF_COLUMNS = ("prefill_replica", "decode_replica", "prefill_time", "decode_wait", "link_wait",
                   "link_time", "transfer_time", "transfer_bytes")


def kv_block_bytes(shape: ModelShape, block_size: int, tensor_parallel_size: int = 1,
                   kv_dtype_bytes: int | None = None) -> int:
    """Bytes of one KV block over all layers on one tensor-parallel rank: layers x block_size x 2
    (K, V) x KV heads per rank x head_dim x bytes per element (default: the model's dtype)."""
    split = tp_split(shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size,
                     shape.vocab_size, tensor_parallel_size, shape.name)
    elem = shape.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    return shape.num_hidden_layers * block_size * 2 * split.num_kv_heads * shape.head_dim * elem


@dataclass(slots=True)
class KVHandoff:
    """One request moving from a prefill replica to a decode replica (both sides read and fill it).

    Set by the prefill side (`PrefillSide`): the request, its computed tokens, the first token of
    each sample, which samples already ended there, the source block ids, the block count and the
    bytes per rank. Set by the decode side (`DecodeSide`): the replica and the destination block ids
    (allocated before any byte is sent). `abort_reason`: the request was aborted while handed off.
    """

    request: Request
    num_computed_tokens: int  # prompt positions whose KV moves (the prompt's length)
    first_token_ids: list[int]  # the first sampled token of each sample, in sample order
    finished_samples: dict[int, str]  # sample index -> finish reason, for samples that ended on the prefill side
    block_ids: list[int]  # the prefill side's blocks holding those positions, in order
    num_bytes: int  # bytes one tensor-parallel rank sends
    prefill_replica: int
    prefill_end_time: float
    first_scheduled_time: float | None = None  # on the prefill side (queueing ends)
    num_preemptions: int = 0  # on the prefill side
    decode_replica: int | None = None
    dst_block_ids: list[int] = field(default_factory=list)  # the decode side's blocks, allocated before the send
    reserved_time: float | None = None
    transfer_start_time: float | None = None
    transfer_end_time: float | None = None
    abort_reason: str | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def row_columns(self) -> dict[str, object]:
        """The HANDOFF_COLUMNS of the request's row, once the transfer is done."""
        end, reserved, start = self.transfer_end_time, self.reserved_time, self.transfer_start_time
        if end is None or reserved is None or start is None:
            raise ValueError(f"hand-off of {self.request_id!r} is not done: no transfer_end_time yet")
        first = self.first_scheduled_time
        return {"prefill_replica": self.prefill_replica, "decode_replica": self.decode_replica,
                "prefill_time": None if first is None else self.prefill_end_time - first,
                "decode_wait": reserved - self.prefill_end_time, "link_wait": start - reserved,
                "link_time": end - start, "transfer_time": end - self.prefill_end_time,
                "transfer_bytes": self.num_bytes}


def transfer_batches(reserved: Sequence[KVHandoff], max_blocks: int) -> list[list[KVHandoff]]:
    """Hand-offs reserved together on a decode replica (in reservation order), grouped into KV
    messages: consecutive ones from the same prefill replica share one message up to `max_blocks`
    blocks (one larger goes alone). Each message pays the link's fixed cost once, as the engine
    pair's does (one gather, one send, one scatter)."""
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
        raise ValueError(f"max_blocks={max_blocks!r} is invalid: must be an integer >= 1")
    batches: list[list[KVHandoff]] = []
    blocks = 0
    for handoff in reserved:
        last = batches[-1] if batches else None
        if last is not None and last[0].prefill_replica == handoff.prefill_replica \
                and blocks + handoff.num_blocks <= max_blocks:
            last.append(handoff)
            blocks += handoff.num_blocks
        else:
            batches.append([handoff])
            blocks = handoff.num_blocks
    return batches
