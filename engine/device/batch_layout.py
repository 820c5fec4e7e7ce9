"""One step's device inputs packed into one buffer: numpy fills a pinned host buffer, one
non-blocking copy moves it to the device, and the model reads typed views of the device buffer.

`BatchShape` holds the sizes of a step (or of a CUDA graph's bucket); `layout(shape)` places every
field at a 16-byte-aligned offset. The layout is a pure function of the shape, so the views a graph
was captured on are exactly where a later step of the same shape writes its bytes.

Why 16: Triton specializes a kernel on whether each pointer argument is 16-byte aligned. With
fields only 8-byte aligned, the alignment of the metadata views (block tables, cu_seqlens, context
lengths, the tile map) changed with the step's sizes, and eager steps of new sizes compiled new
variants of the attention kernels mid-run (1.5-2 s each on an H200 with an empty Triton cache).
At 16 every field is aligned in every shape, so each kernel compiles once.

The block tables' width follows policies/block_table_width.py (`table_width`: a multiple of 16,
for the same reason with Triton's integer specialization).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 16  # Triton's pointer specialization (see above)


@dataclass(slots=True, frozen=True)
class BatchShape:
    num_tokens: int  # T: batch rows
    num_decode_rows: int  # D: rows [0, D) run the decode kernel
    num_prefill_seqs: int  # S
    num_sample_rows: int  # R: rows whose logits are computed
    width: int  # W: block-table columns
    num_tiles: int = 0  # N: prefill tile-map rows (0: the eager grid, sized from max_seqlen_q)

    def fields(self) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
        t, d, s, r, w = self.num_tokens, self.num_decode_rows, self.num_prefill_seqs, self.num_sample_rows, self.width
        return (("input_ids", torch.int64, (t,)), ("positions", torch.int64, (t,)),
                ("slot_mapping", torch.int64, (t,)), ("sample_rows", torch.int64, (r,)),
                ("temperatures", torch.float32, (r,)), ("decode_context_lens", torch.int32, (d,)),
                ("decode_order", torch.int32, (d,)),
                ("prefill_cu_seqlens_q", torch.int32, (s + 1,)), ("prefill_context_lens", torch.int32, (s,)),
                ("prefill_tiles", torch.int32, (self.num_tiles, 2)),
                ("decode_block_tables", torch.int32, (d, w)), ("prefill_block_tables", torch.int32, (s, w)))

    def fits_in(self, other: BatchShape) -> bool:
        return (self.num_tokens <= other.num_tokens and self.num_decode_rows <= other.num_decode_rows
                and self.num_prefill_seqs <= other.num_prefill_seqs
                and self.num_sample_rows <= other.num_sample_rows and self.width <= other.width
                and self.num_tiles <= other.num_tiles)


Field = tuple[int, torch.dtype, tuple[int, ...]]  # (byte offset, dtype, shape)


@functools.lru_cache(maxsize=512)
def layout(shape: BatchShape) -> tuple[dict[str, Field], int]:
    """{field: (offset, dtype, shape)} and the total bytes."""
    fields, offset = {}, 0
    for name, dtype, dims in shape.fields():
        fields[name] = (offset, dtype, dims)
        nbytes = int(np.prod(dims)) * dtype.itemsize
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return fields, offset


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def _byte_slices(shape: BatchShape):
    """(field, byte slice of the buffer, dtype, dims) for each of `shape`'s fields."""
    for name, (off, dtype, dims) in layout(shape)[0].items():
        yield name, slice(off, off + int(np.prod(dims)) * dtype.itemsize), dtype, dims


class InputBuffers:
    """A pinned host buffer and its device twin (on CPU one buffer serves both), large enough for
    every shape that `fits_in` the capacity."""

    def __init__(self, capacity: BatchShape, device: torch.device) -> None:
        self.capacity = capacity
        nbytes = layout(capacity)[1]
        self.pinned = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self._host_np = self.host.numpy()
        self.device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device) if self.pinned else self.host
        # Recorded after each copy: the host buffer is rewritten only once the copy has read it.
        self._copied = torch.cuda.Event() if self.pinned else None
        self._host_views: dict[BatchShape, dict[str, np.ndarray]] = {}

    def host_views(self, shape: BatchShape) -> dict[str, np.ndarray]:
        """Writable numpy views of `shape`'s fields (waits for the previous copy to finish)."""
        if self._copied is not None:
            self._copied.synchronize()
        views = self._host_views.get(shape)
        if views is None:
            if len(self._host_views) >= 256:
                self._host_views.clear()
            host = self._host_np
            views = self._host_views[shape] = {name: host[span].view(_NUMPY[dtype]).reshape(dims)
                                               for name, span, dtype, dims in _byte_slices(shape)}
        return views

    def device_views(self, shape: BatchShape) -> dict[str, torch.Tensor]:
        buf = self.device_buffer
        return {name: buf[span].view(dtype).view(dims) for name, span, dtype, dims in _byte_slices(shape)}

    def upload(self, shape: BatchShape) -> None:
        """Copy `shape`'s bytes to the device (stream-ordered before whatever runs next)."""
        if not self.pinned:
            return
        nbytes = layout(shape)[1]
        self.device_buffer[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        self._copied.record()
