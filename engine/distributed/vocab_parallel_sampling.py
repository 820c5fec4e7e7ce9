"""The fast sampling path under tensor parallelism without gathering the logits.

Each rank's LM-head shard computes its columns of the logits ([R, vocab / N]). Gathering them
moves R x vocab values into every rank (Qwen3-8B at 256 rows: 78 MB of bf16 a decode step), plus
the copies that put each rank's block of columns side by side. When every sampled row needs only
its temperature (the sampler's fast path), each rank instead draws from its own columns
(`kernels.sample_gumbel_shard`: Gumbel-max with the noise each column gets in the whole row) and
the ranks exchange one (best score, its column) pair per row, 8 bytes, in one all-gather; the best
score over the ranks, lowest column on ties, is the token the whole-row draw gives with the same
seed, greedy rows included (their score is the logit). Every rank takes part in the exchange (it
is a collective), so the workers run this too, told by the step header
(engine/distributed/step_message.py) which rows, which seed.
"""
from __future__ import annotations

import torch

import kernels
from engine.distributed.parallel_state import TPGroup


def best_of_shards(pairs: torch.Tensor) -> torch.Tensor:
    """pairs [N, 2, R] (each rank's best score and its column per row, in rank order: rank r's
    columns all lie below rank r + 1's) -> the winning column per row (int64 [R]): the highest
    score, the lowest column among equal ones, i.e. the first rank holding the highest score
    (argmax returns the first of equal maxima). Three launches: this runs every step."""
    first = pairs[:, 0].argmax(dim=0, keepdim=True)
    return pairs[:, 1].gather(0, first).squeeze(0).to(torch.int64)


def sample_vocab_parallel(local_logits: torch.Tensor, temperatures: torch.Tensor, seed: int, group: TPGroup,
                          vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Every rank: its logits' columns [vocab_start, vocab_start + C) of the sampled rows -> the
    sampled tokens (int64 [R], the same on every rank). Launches only: no device sync."""
    pairs = kernels.sample_gumbel_shard(local_logits, temperatures, seed, vocab_start, vocab_size)
    return best_of_shards(group.all_gather_stacked(pairs))
