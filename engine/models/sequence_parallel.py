"""The sequence-parallel forward of a tensor-parallel Llama-family shard (Megatron-LM's sequence
parallelism with torchtitan's async TP), for eager steps of many rows
(`TPGroup.takes_sequence_parallel`: `sequence_parallel_min_rows`).

Why: a prefill step of T rows all-reduces T x hidden values at each of a layer's two boundaries, on
the GEMMs' critical path. Here, between two boundaries, each rank holds only its 1/N of the rows
of the residual stream, and each boundary is split in two halves that overlap with the GEMMs next
to them (torch's fused symmetric-memory ops on GPUs, engine/distributed/row_collectives.py):
- a row-parallel GEMM (o_proj, down_proj) is matmul + reduce-scatter: this rank's rows of the sum
  (its bias added after), then the residual add and RMSNorm on those rows only (1/N of the work);
- a column-parallel GEMM (qkv, gate_up) is all-gather + matmul: every row, this rank's columns.
Attention runs on every row of this rank's heads, as on the all-reduce path, so its metadata, KV
cache writes and kernels are unchanged. The vocabulary-parallel embedding's summands are
reduce-scattered; at the end the final norm runs on this rank's rows and the rows are all-gathered
for the logits.

Rows: the step's T rows are padded to N x S (S = ceil(T / N)) with id -1, whose embedding is zero on
every rank; rank r holds rows [r S, (r + 1) S). Attention sees the first T rows only (its output is
padded again with zero rows for o_proj); every other op is row-wise, so whatever the padded rows
hold never reaches a real row, and they are dropped at the end.

Every rank makes the same collectives in the same order (the choice is a function of the step's row
count and the config); CUDA-graph captures never take this path (`StepGraphs` passes
`sequence_parallel=False`, and steps this large are not captured).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.device.attention import AttentionMetadata
from engine.distributed.parallel_state import TPGroup
from engine.models.ops import rope_rows
from policies.sequence_parallel import padded_rows

# The model and its layers are engine/models/llama.py's (`ShardedLlamaForCausalLM`, `DecoderLayer`),
# typed here as modules: llama.py calls into this file, which therefore does not import it.


def sequence_parallel_forward(model: nn.Module, input_ids: torch.Tensor,
                              positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """input_ids, positions [T] -> final-normed hidden states [T, hidden] on every rank, as
    `LlamaForCausalLM.forward` gives them (up to the order of the sums)."""
    group = model.tp.group
    rows = input_ids.shape[0]
    padded = padded_rows(rows, group.size)
    ids = input_ids if padded == rows else torch.cat([input_ids, input_ids.new_full((padded - rows,), -1)])
    x = model.embed_tokens.lookup(ids)
    group.begin_forward()  # every forward of a sharded model starts here
    x = group.reduce_scatter_rows(x)
    rope = rope_rows(model.rotary.cos_sin, positions, x.dtype)
    residual = None
    for layer in model.layers:
        x, residual = layer_forward(layer, group, rows, rope, x, residual, meta)
    return group.all_gather_rows(model.norm.add_forward(x, residual)[0])[:rows]


def layer_forward(layer: nn.Module, group: TPGroup, rows: int, rope: torch.Tensor, x: torch.Tensor,
                  residual: torch.Tensor | None,
                  meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer on this rank's rows: x [S, hidden], the previous layer's MLP output (or the
    embeddings) and residual [S, hidden], the stream before it (None for the first layer) ->
    (this layer's MLP output, residual), both [S, hidden]. `rows`: the step's rows before padding."""
    if residual is None:
        h, residual = layer.input_layernorm(x), x
    else:
        h, residual = layer.input_layernorm.add_forward(x, residual)
    attn = layer.self_attn
    qkv = gather_linear(group, h, attn.qkv_proj)[:rows]
    o = pad_rows(attn.attend_rows(rope, qkv, meta), h.shape[0] * group.size)
    h, residual = layer.post_attention_layernorm.add_forward(scatter_linear(group, o, attn.o_proj), residual)
    mlp = layer.mlp
    activated = mlp.fns.silu_and_mul(gather_linear(group, h, mlp.gate_up_proj))  # padded rows stay zero
    return scatter_linear(group, activated, mlp.down_proj), residual


def gather_linear(group: TPGroup, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """A column-parallel layer on the gathered rows: [S, in] per rank -> [N S, this rank's out]."""
    y = group.all_gather_matmul(x, linear.weight)
    return y if linear.bias is None else y.add_(linear.bias)


def scatter_linear(group: TPGroup, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """A row-parallel layer (`RowParallelLinear`) reduce-scattered: [N S, this rank's in] -> this
    rank's S rows of the sum, the bias added once."""
    y = group.matmul_reduce_scatter(x, layer.weight)
    return y if layer.bias is None else y.add_(layer.bias)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [T, C] with zero rows appended up to `rows` (x itself when it has them)."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])
