"""What tensor parallelism changes in a step's price (sim/latency/roofline.py).

Each of N GPUs holds 1/N of the heads, the MLP and the vocabulary (`policies.tensor_parallel`):
`shard_shape` is the model one GPU computes, so its weight and KV bytes and its FLOPs come out
per GPU. The GPUs then exchange activations: a row-parallel layer's partial sums are all-reduced
twice per decoder layer (after o_proj and after down_proj) plus once after the vocab-parallel
embedding, each over the step's [tokens, hidden] activations, and each sampled row's best
(score, column) pair, 8 bytes per rank, is all-gathered once (the sampler's fast path draws from
each rank's vocabulary columns: engine/distributed/vocab_parallel_sampling.py). With a ring over
links of bandwidth B (bytes/s each way per GPU) and latency a:

    all_reduce(n bytes) = a + 2 (N - 1) / N * n / B
    all_gather(n bytes of output) = a + (N - 1) / N * n / B

so a step of T tokens and R sampled rows costs (2 L + 1) * all_reduce(T h b) + all_gather(8 N R)
with L layers, hidden size h and b bytes per element. N = 1 costs nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from policies.tensor_parallel import tp_split
from sim.latency.shapes import Hardware, ModelShape

SAMPLED_PAIR_BYTES = 8  # a float32 score and its column, per sampled row and rank


def shard_shape(model: ModelShape, size: int) -> ModelShape:
    """The model one of `size` GPUs computes (its heads, MLP columns and vocabulary rows)."""
    if size == 1:
        return model
    split = tp_split(model.num_attention_heads, model.num_key_value_heads, model.intermediate_size, model.vocab_size, size,
                     model.name)
    return dataclasses.replace(model, num_attention_heads=split.num_heads, num_key_value_heads=split.num_kv_heads,
                               intermediate_size=split.intermediate_size, vocab_size=split.vocab_size)


@dataclass(slots=True, frozen=True)
class RingLink:
    """The ring formulas above for `size` GPUs over links of `bandwidth` B/s each way per GPU and
    `latency_s` per collective (`hardware.interconnect_bandwidth` / `interconnect_latency_s`)."""

    size: int
    bandwidth: float
    latency_s: float

    @classmethod
    def of(cls, hardware: Hardware, size: int) -> RingLink:
        bw, latency = hardware.interconnect_bandwidth, hardware.interconnect_latency_s
        if bw is None or latency is None:
            raise ValueError(f"hardware.interconnect_bandwidth / interconnect_latency_s of {hardware.name!r} "
                             f"are missing: tensor_parallel_size={size} needs the GPU-to-GPU link's figures")
        return cls(size, bw, latency)

    def all_reduce_transfer_s(self, nbytes: float) -> float:
        """Seconds of an all-reduce of `nbytes` on the links, the latency excluded."""
        return 2 * ((self.size - 1) / self.size) * nbytes / self.bandwidth

    def all_gather_transfer_s(self, nbytes: float) -> float:
        """Seconds of an all-gather of `nbytes` of output on the links, the latency excluded."""
        return ((self.size - 1) / self.size) * nbytes / self.bandwidth

    def all_reduce_s(self, nbytes: float) -> float:
        return self.latency_s + self.all_reduce_transfer_s(nbytes)

    def all_gather_s(self, nbytes: float) -> float:
        return self.latency_s + self.all_gather_transfer_s(nbytes)


@dataclass(slots=True, frozen=True)
class TPCommCost:
    """Seconds of a step's tensor-parallel communication: `fixed_s + tokens * per_token_s +
    samples * per_sample_s` (all 0 for one GPU)."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0
    per_sample_s: float = 0.0

    @classmethod
    def of(cls, model: ModelShape, hardware: Hardware, size: int) -> TPCommCost:
        if size == 1:
            return cls()
        link = RingLink.of(hardware, size)
        num_all_reduces = 2 * model.num_hidden_layers + 1
        return cls(fixed_s=(num_all_reduces + 1) * link.latency_s,
                   per_token_s=num_all_reduces * link.all_reduce_transfer_s(model.hidden_size * model.dtype_bytes),
                   per_sample_s=link.all_gather_transfer_s(SAMPLED_PAIR_BYTES * size))

    def step_s(self, tokens: int, samples: int) -> float:
        return self.fixed_s + tokens * self.per_token_s + samples * self.per_sample_s
