"""The engine limits a step profile is measured under (conf/profile.yaml) and the check that every
shape of its grid is one the engine runs under them, made before the runner is built.

A shape over a limit is either never run by the engine (so a row timed for it would run eagerly,
off the CUDA graphs, and skew the interpolation of its neighbours) or cannot run at all: a
sequence longer than max_model_len has no rotary row and no block-table column for its last
tokens (on a GPU, a device-side assert after minutes of timing). The sequences of the grid, as
experiments/lib/profiling/synthetic.py builds them and the profile's `prefill_layout` states:
- a prefill row of P tokens is one sequence of P tokens (no prefix); a split row, P tokens over k
  sequences in one step;
- a decode of context C is one sequence of C tokens (its new one included), spread around the
  row's mean by `decode_contexts`; a decode-only row is also timed as an engine's step period
  (profiling/host.py `decode_periods`), its sequences growing one token per step for
  `warmup + host_repeats` steps.
"""
from __future__ import annotations

from dataclasses import dataclass

from experiments.lib.profiling.grid import ProfileGrid
from experiments.lib.profiling.synthetic import decode_contexts

# Said with every override the errors suggest: the profile is for engine runs with its limits.
SAME_LIMITS = "(the engine runs the profile is for must use the same)"


@dataclass(slots=True, frozen=True)
class EngineLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    decode_growth: int = 0  # tokens a decode-only row's sequences gain while its period is timed

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")


def check_grid(grid: ProfileGrid, limits: EngineLimits) -> None:
    """ValueError naming the first grid field with a shape over `limits`: its value, what is
    allowed, and the override that would allow it."""
    budget, seqs, max_len = limits.max_num_batched_tokens, limits.max_num_seqs, limits.max_model_len
    prefill = max(grid.prefill_tokens)
    decodes = max(grid.decode_seqs)
    if prefill > max_len:
        raise ValueError(
            f"profile_grid.prefill_tokens holds {prefill}, invalid with max_model_len={max_len}: each prefill "
            f"row is timed as one sequence of that many tokens (the profile's prefill_layout), so it must be "
            f"<= {max_len}; drop it{' (and from split_prefill_tokens)' if prefill in grid.split_prefill_tokens else ''}"
            f" or set max_model_len={prefill} {SAME_LIMITS}")
    if decodes > seqs:
        raise ValueError(
            f"profile_grid.decode_seqs holds {decodes}, invalid with max_num_seqs={seqs}: a decode row's "
            f"sequences must be <= {seqs} (the engine's batches never exceed it); drop it or set "
            f"max_num_seqs={decodes} {SAME_LIMITS}")
    if decodes > budget:
        raise ValueError(
            f"profile_grid.decode_seqs holds {decodes}, invalid with max_num_batched_tokens={budget}: a "
            f"decode row's tokens (one per sequence) must be <= {budget}; drop it or set "
            f"max_num_batched_tokens={decodes} {SAME_LIMITS}")
    if prefill and prefill + decodes > budget:
        raise ValueError(
            f"profile_grid.prefill_tokens holds {prefill} and decode_seqs {decodes}, invalid with "
            f"max_num_batched_tokens={budget}: a step's prefill tokens plus its decodes must be <= {budget} "
            "(the engine never runs such a step; timed, it would run eagerly and skew its neighbours in the "
            f"interpolation); shrink either or set max_num_batched_tokens={prefill + decodes} {SAME_LIMITS}")
    if prefill and decodes + 1 > seqs:
        raise ValueError(
            f"profile_grid.decode_seqs holds {decodes}, invalid beside a prefill with max_num_seqs={seqs}: "
            f"must be <= max_num_seqs - 1 = {seqs - 1} (the prefill is a sequence too); drop it or set "
            f"max_num_seqs={decodes + 1} {SAME_LIMITS}")
    split = max(grid.split_counts)
    if split > seqs:
        raise ValueError(
            f"profile_grid.split_counts holds {split}, invalid with max_num_seqs={seqs}: a split row's "
            f"sequences must be <= {seqs}; drop it or set max_num_seqs={split} {SAME_LIMITS}")
    decodes_needs = [(max(decode_contexts(s.num_decode_seqs, s.context_per_decode, s.context_ratio))
                      + (limits.decode_growth if s.num_prefill_tokens == 0 else 0), s)
                     for s in grid.step_shapes() if s.num_decode_seqs]
    need, shape = max(decodes_needs, key=lambda x: x[0], default=(0, None))
    if need > max_len:  # the row needing the most: its override allows every row
        grows = limits.decode_growth if shape.num_prefill_tokens == 0 else 0
        spread = (f"context_ratios {shape.context_ratio} times it" if shape.context_ratio is not None
                  else "spread from 1/4 to 7/4 of it")
        growth = (f" plus the {grows} tokens it grows while its engine period is timed (warmup + host_repeats)"
                  if grows else "")
        raise ValueError(
            f"profile_grid.context_per_decode holds {shape.context_per_decode}, invalid with max_model_len="
            f"{max_len}: the longest decode of the row of {shape.num_decode_seqs} sequences at that mean context "
            f"holds {need - grows} tokens ({spread}){growth}, which must be <= {max_len}; lower it (or "
            f"context_ratios) or set max_model_len={need} {SAME_LIMITS}")
