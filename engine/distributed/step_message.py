"""What rank 0 sends the workers each step, and how.

A step's message has two parts:
- the header, a few int64s as raw bytes down each worker's pipe: the step's cache operations
  (swap out, swap in, block copies), and the shape of its input buffer (`BatchShape`) with whether
  it replays a CUDA graph and the eager prefill grid's `max_seqlen_q`, and how its sampled rows
  are sampled after the forward (each a collective every rank joins: the fast path's exchange with
  its Philox seed, engine/distributed/vocab_parallel_sampling.py, or the logits gathered for the
  full sampler; `sample_rows` of them). A pipe lets an idle worker
  wait for the next step without a deadline (collectives have one: it is how a hung rank is
  found) and tells it at once when rank 0 is gone (end of file);
- the inputs themselves: the packed bytes of `engine.device.batch_layout` that rank 0 already uploads to
  its device (token ids, positions, slot mapping, block tables, ...), broadcast from rank 0's device
  buffer into each worker's (`broadcast_inputs`: NCCL on GPUs, device to device; gloo on CPUs). Tokens
  sampled by the step before (async scheduling) are in rank 0's buffer by then, so they travel with it.
No Python object is pickled per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist

from engine.device.batch_layout import BatchShape, InputBuffers, layout

_STOP, _STEP = 0, 1
_FIXED = 14  # kind, flags, 6 shape fields, max_seqlen_q, sample_rows, seed, 3 cache-op counts


@dataclass(slots=True)
class StepHeader:
    shape: BatchShape | None = None  # None: cache operations only
    graph: bool = False  # replay the CUDA graph of `shape`
    max_seqlen_q: int = 0
    sample_rows: int = 0  # the sampled rows (the first of the logits), 0: none
    fast_sampling: bool = False  # sampled by the fast path's exchange (else their logits gathered)
    seed: int = 0  # the fast path's Philox seed
    swap_out: dict[int, int] = field(default_factory=dict)
    swap_in: dict[int, int] = field(default_factory=dict)
    copy: list[tuple[int, int]] = field(default_factory=list)
    stop: bool = False  # the engine is closing: leave the loop

    def encode(self) -> bytes:
        s = self.shape
        dims = (0,) * 6 if s is None else (s.num_tokens, s.num_decode_rows, s.num_prefill_seqs,
                                            s.num_sample_rows, s.width, s.num_tiles)
        flags = int(self.graph) | (s is not None) << 1 | int(self.fast_sampling) << 2
        head = [_STOP if self.stop else _STEP, flags, *dims, self.max_seqlen_q, self.sample_rows, self.seed,
                len(self.swap_out), len(self.swap_in), len(self.copy)]
        pairs = [*self.swap_out.items(), *self.swap_in.items(), *self.copy]
        return np.array(head + [x for p in pairs for x in p], dtype=np.int64).tobytes()

    @classmethod
    def decode(cls, data: bytes) -> StepHeader:
        v = np.frombuffer(data, dtype=np.int64).tolist()
        if v[0] == _STOP:
            return cls(stop=True)
        shape = BatchShape(*v[2:8]) if v[1] & 2 else None
        a, b, c = v[11:14]
        pairs = list(zip(v[_FIXED::2], v[_FIXED + 1::2]))
        return cls(shape, bool(v[1] & 1), v[8], v[9], bool(v[1] & 4), v[10], dict(pairs[:a]), dict(pairs[a:a + b]),
                   pairs[a + b:a + b + c])


def broadcast_inputs(buffers: InputBuffers, shape: BatchShape, group: dist.ProcessGroup) -> None:
    """Rank 0's device input bytes of `shape` into every rank's (stream-ordered on GPUs)."""
    dist.broadcast(buffers.device_buffer[:layout(shape)[1]], src=0, group=group)
