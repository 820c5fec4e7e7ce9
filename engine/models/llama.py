"""One forward pass for the Llama family: Llama, Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each
q/k head), over a flattened varlen batch whose attention goes through the paged KV cache.

Parameters use a fused layout (q/k/v in `qkv_proj`, gate/up in `gate_up_proj`); `engine/device/weights.py`
maps transformers' names onto it. Arithmetic follows transformers' modeling code step by step
(float32 RMSNorm, cos/sin cast to the activation dtype, residual adds in the activation dtype) so
that bf16 logits stay close to theirs; the residual add is fused into the next RMSNorm.
`forward` returns hidden states; `compute_logits` is called only on the rows that are sampled.
"""
from __future__ import annotations

from types import ModuleType, SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.device.attention import AttentionMetadata, PagedAttention
from engine.distributed.parallel_state import TPGroup
from engine.models.ops import fused_ops, rope_rows
from engine.models.parallel_layers import PartialSum, TPContext, embedding, gather_logits, row_linear
from engine.models.registry import register_model
from engine.models.rope import RotaryEmbedding
from engine.models.sequence_parallel import sequence_parallel_forward


class RMSNorm(nn.Module):
    """The epsilon is bound in `fns` (one per model)."""

    def __init__(self, size: int, fns: SimpleNamespace) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.fns = fns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fns.rms_norm(x, self.weight)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return self.fns.add_rms_norm(x, residual, self.weight)


class ReducingRMSNorm(RMSNorm):
    """A tensor-parallel shard's RMSNorm: also takes the previous row-parallel layer's partial
    sums un-reduced (`PartialSum`) and sums them over the ranks with the residual add and the norm,
    in one kernel where the group fuses them (`TPGroup.all_reduce_add_rms_norm`)."""

    def __init__(self, size: int, fns: SimpleNamespace, group: TPGroup, eps: float) -> None:
        super().__init__(size, fns)
        self.group = group
        self.eps = eps

    def forward(self, x: torch.Tensor | PartialSum) -> torch.Tensor:
        return super().forward(self.group.all_reduce(x.partial) if isinstance(x, PartialSum) else x)

    def add_forward(self, x: torch.Tensor | PartialSum, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, PartialSum):
            return self.group.all_reduce_add_rms_norm(x.partial, residual, self.weight, self.eps, self.fns.add_rms_norm)
        return super().add_forward(x, residual)


def rms_norm_layer(size: int, fns: SimpleNamespace, eps: float, tp: TPContext | None) -> RMSNorm:
    """The plain RMSNorm without tensor parallelism; a shard's takes un-reduced partial sums."""
    return RMSNorm(size, fns) if tp is None else ReducingRMSNorm(size, fns, tp.group, eps)


class Attention(nn.Module):
    """`cfg`: the rank's local config under tensor parallelism (its heads), else the model's."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: ModuleType, fns: SimpleNamespace,
                 tp: TPContext | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = row_linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, tp, feeds_norm=True)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, fns)
            self.k_norm = RMSNorm(self.head_dim, fns)
        self.fns = fns
        self.eps = cfg.rms_norm_eps
        self.attn = PagedAttention(ops, layer_idx, scale=self.head_dim ** -0.5)
        # The Triton ops' q/k norm + rope + KV write in one kernel (kernels/qk_rope_cache.py, head_dim a
        # power of two); the references have none: then the elementwise ops below and the cache write.
        pow2 = self.head_dim & (self.head_dim - 1) == 0
        self.fused_qk_rope_write = getattr(ops, "qk_norm_rope_write", None) if pow2 else None

    def forward(self, rope: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """rope: the step's cos/sin rows [T, 2, head_dim] (`ops.rope_rows`)."""
        return self.o_proj(self.attend_rows(rope, self.qkv_proj(x), meta))

    def attend_rows(self, rope: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, q + 2 kv] (the projection, bias added) -> attention output [T, q] (before o_proj):
        q/k norms, rope, the KV cache write and the paged attention."""
        if self.fused_qk_rope_write is not None:
            weights = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            q = self.fused_qk_rope_write(qkv, self.num_heads, *weights, self.eps, rope, *self.attn.caches(),
                                         meta.slot_mapping)
            return self.attn.attend(q, meta).reshape(-1, self.q_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.fns.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, rope)
        else:
            q, k = self.fns.apply_rope(q, k, rope)
        o = self.attn(q, k, v, meta)  # the kernels take strided rows (v is a view of qkv)
        return o.reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fns: SimpleNamespace, tp: TPContext | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = row_linear(cfg.intermediate_size, cfg.hidden_size, False, tp, feeds_norm=True)
        self.fns = fns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.fns.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: ModuleType, fns: SimpleNamespace,
                 tp: TPContext | None = None) -> None:
        super().__init__()
        self.input_layernorm = rms_norm_layer(cfg.hidden_size, fns, cfg.rms_norm_eps, tp)
        self.self_attn = Attention(cfg, layer_idx, ops, fns, tp)
        self.post_attention_layernorm = rms_norm_layer(cfg.hidden_size, fns, cfg.rms_norm_eps, tp)
        self.mlp = MLP(cfg, fns, tp)

    def forward(self, rope: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (or the embeddings); residual: the stream before it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(rope, h, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


@register_model("llama", "qwen2", "qwen3")
class LlamaForCausalLM(nn.Module):
    """`ops`: the attention kernels module (`kernels` or `kernels.reference`); `compile`: wrap the
    elementwise pieces in torch.compile (GPU); `tp`: the layers of one tensor-parallel rank's shard
    (built as `ShardedLlamaForCausalLM`, the class's `sharded`)."""

    def __init__(self, cfg: ModelConfig, ops: ModuleType, max_positions: int | None = None,
                 compile: bool = False, tp: TPContext | None = None) -> None:
        super().__init__()
        self.config = cfg
        local = cfg if tp is None else tp.shard.local_config(cfg)
        fns = fused_ops(compile, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(local, i, ops, fns, tp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = rms_norm_layer(cfg.hidden_size, fns, cfg.rms_norm_eps, tp)
        if not cfg.tie_word_embeddings:
            vocab = cfg.vocab_size if tp is None else tp.shard.vocab
            self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def bind_kv_cache(self, k_caches: list[torch.Tensor | None], v_caches: list[torch.Tensor | None]) -> None:
        for layer, k, v in zip(self.layers, k_caches, v_caches, strict=True):
            layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = k, v

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                sequence_parallel: bool | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]. `sequence_parallel`:
        a shard's choice of layer boundaries (`ShardedLlamaForCausalLM`); one model has none."""
        if sequence_parallel:
            raise ValueError("sequence_parallel=True is invalid without tensor parallelism")
        x, residual = self.embed_tokens(input_ids), None
        rope = rope_rows(self.rotary.cos_sin, positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        return self.norm.add_forward(x, residual)[0]

    @property
    def vocab_columns(self) -> tuple[int, int]:
        """(first column, width) of the logits this model computes (`compute_local_logits`)."""
        return 0, self.config.vocab_size

    def compute_local_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [R, hidden] (only the sampled rows) -> this model's logit columns [R, width]
        (`vocab_columns`) in the model's dtype, written straight into `out` (an [R, width] buffer of
        that dtype) if given. No float32 copy: the matmul rounds to the model's dtype anyway, so a
        float32 copy adds no information, and the fast sampler reads bf16 (half the bytes);
        `Sampler` upcasts for its float32 math."""
        if out is None:
            return F.linear(hidden, self.lm_head_weight)
        return torch.mm(hidden, self.lm_head_weight.t(), out=out)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """`compute_local_logits`' output -> logits [R, vocab]: here the same tensor."""
        return local

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] (only the sampled rows) -> logits [R, vocab] in the model's dtype."""
        return self.gather_logits(self.compute_local_logits(hidden))


class ShardedLlamaForCausalLM(LlamaForCausalLM):
    """One tensor-parallel rank's shard: the forward all-reduces inside its row-parallel layers and
    embedding (or, for steps of many rows, runs sequence-parallel: `forward`);
    `compute_local_logits` gives this rank's vocabulary columns and `gather_logits` every rank's
    (all ranks get them, a collective; the sampler runs on rank 0, its fast path without the
    gather: engine/distributed/vocab_parallel_sampling.py)."""

    def __init__(self, cfg: ModelConfig, ops: ModuleType, max_positions: int | None = None,
                 compile: bool = False, *, tp: TPContext) -> None:
        super().__init__(cfg, ops, max_positions, compile, tp)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                sequence_parallel: bool | None = None) -> torch.Tensor:
        """`sequence_parallel`: run the layers sequence-parallel (engine/models/sequence_parallel.py);
        None: if the step's rows reach the group's `sequence_parallel_min_rows` (every rank decides
        alike). CUDA graphs capture with False: their steps keep the all-reduces."""
        if sequence_parallel is None:
            sequence_parallel = self.tp.group.takes_sequence_parallel(input_ids.shape[0])
        if sequence_parallel:
            return sequence_parallel_forward(self, input_ids, positions, meta)
        return super().forward(input_ids, positions, meta)

    @property
    def vocab_columns(self) -> tuple[int, int]:
        return self.tp.shard.vocab_start, self.tp.shard.vocab

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        return gather_logits(local, self.tp.group, self.config.vocab_size)


LlamaForCausalLM.sharded = ShardedLlamaForCausalLM  # what `build_model` builds for one tensor-parallel rank
