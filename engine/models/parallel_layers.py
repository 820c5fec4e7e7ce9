"""Layers of a tensor-parallel model shard (`engine.distributed.sharding` says what each rank holds).

Column-parallel layers are plain `nn.Linear`s of the rank's output columns (q/k/v, gate/up, the
LM head): nothing to communicate. `RowParallelLinear` (o_proj, down_proj) multiplies the rank's
input columns and all-reduces the partial sums (written straight into the symmetric buffer when
the all-reduce takes it), adding the bias once after the sum.
With the fused layer boundary (`TPGroup.fuses_add_norm`), a layer built with `feeds_norm=True`
returns its partial sums un-reduced, as a `PartialSum` over the symmetric buffer, and the next
RMSNorm (`ReducingRMSNorm` in engine/models/llama.py) sums them with its residual add.
`VocabParallelEmbedding` looks up the rank's vocabulary rows (zero for other ids) and all-reduces.
`gather_logits` puts the ranks' vocabulary columns side by side and drops the padding.

The factories `row_linear` and `embedding` return the single-GPU modules when `tp` is None, so a
model built without tensor parallelism is exactly the one it was before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import TPGroup
from engine.distributed.sharding import TPShard


@dataclass(slots=True, frozen=True)
class TPContext:
    """What a model shard needs: which part it holds, and the group it sums and gathers over."""

    shard: TPShard
    group: TPGroup


@dataclass(slots=True, frozen=True)
class PartialSum:
    """This rank's summand of a row-parallel layer's output, not yet all-reduced: a view of the
    symmetric buffer that the next all-reduce (fused with an RMSNorm) reads from every rank, or
    (the Lamport kernel's messages) any tensor that it pushes to them."""

    partial: torch.Tensor


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b, with x_r and W_r this rank's input columns. `feeds_norm`:
    its output goes straight into an RMSNorm's residual add, so on the fused layer boundary it
    returns the `PartialSum` (no bias to add after the sum) and the norm reduces it."""

    def __init__(self, local_in: int, out_features: int, bias: bool, group: TPGroup, feeds_norm: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, local_in))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group = group
        self.defer = feeds_norm and not bias

    def forward(self, x: torch.Tensor) -> torch.Tensor | PartialSum:
        # On the symmetric-memory paths the GEMM writes its partial sums straight into the buffer
        # the all-reduce reads (no copy in).
        staged = self.group.reduce_input((x.shape[0], self.weight.shape[0]), x.dtype) if x.dim() == 2 else None
        partial = F.linear(x, self.weight) if staged is None else torch.mm(x, self.weight.t(), out=staged)
        if self.defer and self.group.fuses_add_norm:  # the norm falls back to all-reduce + add + norm
            return PartialSum(partial)
        y = self.group.all_reduce(partial)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, shard: TPShard, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shard.vocab, hidden_size))
        self.start, self.end = shard.vocab_start, shard.vocab_start + shard.vocab
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.lookup(ids)
        self.group.begin_forward()  # every forward of a sharded model starts here
        return self.group.all_reduce(x)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's summand of the embeddings: its vocabulary's rows, zero for other ids (any id
        outside the vocabulary, e.g. -1, gives a zero row on every rank)."""
        outside = (ids < self.start) | (ids >= self.end)
        local = torch.where(outside, 0, ids - self.start)
        return F.embedding(local, self.weight).masked_fill_(outside[:, None], 0)


def row_linear(local_in: int, out_features: int, bias: bool, tp: TPContext | None,
               feeds_norm: bool = False) -> nn.Module:
    if tp is None:
        return nn.Linear(local_in, out_features, bias=bias)
    return RowParallelLinear(local_in, out_features, bias, tp.group, feeds_norm)


def embedding(vocab_size: int, hidden_size: int, tp: TPContext | None) -> nn.Module:
    if tp is None:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(tp.shard, hidden_size, tp.group)


def gather_logits(local: torch.Tensor, group: TPGroup, vocab_size: int) -> torch.Tensor:
    """[R, vocab / N] on each rank -> [R, vocab] on every rank."""
    return group.all_gather_columns(local)[:, :vocab_size].contiguous()
