"""Synthetic steps for the profiler: `SchedulerOutput`s over fake sequences with distinct KV blocks.

A step shape is (prefill tokens P in S sequences, D decodes of C context tokens each). Prefill
sequences start at position 0 (no prefix) and sample one token, as a prompt's last chunk does;
the D decodes read D * C KV entries in all, spread as a real batch's are: sequence i of D holds
`decode_contexts(D, C)[i]` tokens, evenly from C / 4 to 7 C / 4 (mean C, the spread of contexts
uniform in [100, 2048]: the decode kernel's programs then finish unevenly, as in the engine), the
new token included, and samples one token. A shape with a context ratio R (the profile's batch-shape
axis) instead gives its longest decode exactly R C tokens and spreads the others around the rest's
mean, none longer than it. Every sequence gets its own physical blocks, so the attention kernels read as
many distinct KV bytes as a real batch of that shape (shared blocks would be served from L2).
`ModelRunner.execute` does not modify sequences, so one synthetic step can be executed repeatedly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.request import Request, SamplingParams
from policies.sequence import Sequence, SequenceStatus

TOKEN_ID_HIGH = 10000  # token ids drawn from [0, 10000), as nano-vllm's benchmark prompts
PROFILE_PARAMS = SamplingParams(temperature=1.0, max_tokens=1 << 20, ignore_eos=True)


@dataclass(slots=True)
class StepShape:
    num_prefill_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    context_per_decode: int  # C: KV entries each decode reads (its new token included)
    context_ratio: float | None = None  # R: longest decode context / C (None: the C/4..7C/4 spread)

    @property
    def num_context_tokens(self) -> int:
        return self.num_decode_seqs * self.context_per_decode if self.num_decode_seqs else 0

    @property
    def prefill_attention_pairs(self) -> int:
        return sum(q * (q + 1) // 2 for q in split_tokens(self.num_prefill_tokens, self.num_prefill_seqs))


def split_tokens(total: int, parts: int) -> list[int]:
    """`total` tokens over `parts` sequences as evenly as possible (0 parts for 0 tokens)."""
    if total == 0:
        return []
    if parts < 1 or parts > total:
        raise ValueError(f"num_prefill_seqs={parts} is invalid for {total} prefill tokens: must be in [1, {total}]")
    return [total // parts + (i < total % parts) for i in range(parts)]


def decode_contexts(num_decode_seqs: int, context_per_decode: int, ratio: float | None = None) -> list[int]:
    """Contexts summing to exactly D * C (each >= 2): from C / 4 to 7 C / 4, or with `ratio` R, the
    last one round(R C) tokens (at most what D sequences of C can hold: D C - 2 (D - 1)) and the
    others spread evenly by up to +-3/4 of their mean m, none above the longest nor below 2."""
    d, c = num_decode_seqs, context_per_decode
    if d == 0:
        return []
    if ratio is None:
        lens = [max(2, round(c * (0.25 + 1.5 * (i + 0.5) / d))) for i in range(d)]
        lens[-1] += d * c - sum(lens)
        return lens
    if ratio < 1:
        raise ValueError(f"context_ratio={ratio} is invalid: must be >= 1 (the longest context over the mean)")
    if d == 1:
        return [c]
    longest = min(max(round(ratio * c), c), d * c - 2 * (d - 1))
    rest = d * c - longest
    m = rest / (d - 1)
    a = max(0.0, min(0.75, longest / m - 1, 1 - 2 / m))
    ideal = [m * (1 - a + 2 * a * (i + 0.5) / (d - 1)) for i in range(d - 1)]
    lens = [math.floor(x) for x in ideal]  # largest remainders round up, so the sum is exact
    for i in sorted(range(d - 1), key=lambda i: lens[i] - ideal[i])[:rest - sum(lens)]:
        lens[i] += 1
    return [*lens, longest]


def blocks_needed(shape: StepShape, block_size: int) -> int:
    pre = sum(math.ceil(q / block_size) for q in split_tokens(shape.num_prefill_tokens, shape.num_prefill_seqs))
    return pre + sum(math.ceil(n / block_size) for n in decode_contexts(shape.num_decode_seqs, shape.context_per_decode,
                                                                        shape.context_ratio))


def _sequence(seq_id: int, num_prompt: int, num_output: int, num_computed: int, first_block: int,
              block_size: int, rng: np.random.Generator, high: int) -> Sequence:
    tokens = rng.integers(0, high, size=num_prompt + num_output).tolist()
    seq = Sequence.from_request(seq_id, Request(f"profile-{seq_id}", tokens[:num_prompt], PROFILE_PARAMS))
    seq.token_ids.extend(tokens[num_prompt:])
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = num_computed
    seq.block_table = list(range(first_block, first_block + math.ceil(seq.num_tokens / block_size)))
    return seq


def synthetic_step(shape: StepShape, block_size: int, num_gpu_blocks: int, vocab_size: int,
                   seed: int = 0) -> SchedulerOutput:
    """One step of `shape` over blocks [0, blocks_needed) with token ids below min(10000,
    vocab_size); raises ValueError if the blocks do not fit."""
    if shape.num_decode_seqs and shape.context_per_decode < 2:
        raise ValueError(f"context_per_decode={shape.context_per_decode} is invalid: a decode reads >= 2 tokens")
    need = blocks_needed(shape, block_size)
    if need > num_gpu_blocks:
        raise ValueError(f"step {shape} needs {need} KV blocks of {block_size} tokens but the profiler's "
                         f"cache has num_gpu_blocks={num_gpu_blocks}: shrink the grid or give it more blocks")
    rng, high = np.random.default_rng(seed), min(TOKEN_ID_HIGH, vocab_size)
    scheduled, next_block, seq_id = [], 0, 0
    for q in split_tokens(shape.num_prefill_tokens, shape.num_prefill_seqs):
        seq = _sequence(seq_id, q, 0, 0, next_block, block_size, rng, high)
        scheduled.append(ScheduledSeq(seq, q, 1))
        next_block += len(seq.block_table)
        seq_id += 1
    for n in decode_contexts(shape.num_decode_seqs, shape.context_per_decode, shape.context_ratio):
        seq = _sequence(seq_id, n - 1, 1, n - 1, next_block, block_size, rng, high)
        scheduled.append(ScheduledSeq(seq, 1, 1))
        next_block += len(seq.block_table)
        seq_id += 1
    return SchedulerOutput(now=0.0, scheduled=scheduled)


def swap_mapping(num_blocks: int, num_gpu_blocks: int, num_cpu_blocks: int) -> dict[int, int]:
    """num_blocks (gpu block -> cpu block) pairs, spread over the GPU pool as a real victim's are."""
    if num_blocks > min(num_gpu_blocks, num_cpu_blocks):
        raise ValueError(f"swap of {num_blocks} blocks is invalid: the profiler has {num_gpu_blocks} GPU and "
                         f"{num_cpu_blocks} CPU blocks (raise swap_space or shrink grid.swap_blocks)")
    stride = max(1, num_gpu_blocks // num_blocks)
    return {i * stride: i for i in range(num_blocks)}
