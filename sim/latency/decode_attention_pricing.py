"""How the `operators` latency model (sim/latency/operators.py) prices one layer's decode attention
on a step's batch: the profile's `decode_attention` rows are timed on batches of equal contexts, and
a real batch is ragged and launched at a CUDA graph's rows, so the context it is priced at and the
kernel's split-KV grid are worked out here, apart from the rest of the step.

Decode attention is measured on batches of equal contexts and priced at the step's mean context
when the batch's programs (one per sequence and KV head, before splits) fill the kernel's wave
(`decode_wave_programs`: programs that run at once, programs per SM x SMs); a batch that leaves
part of the wave idle is not bandwidth-bound as a whole, and its longest sequence's programs set
the kernel's time. Its context is taken between the mean (a full wave) and the longest (an empty
one), by the idle fraction: C = mean + (1 - B Hkv / wave) (longest - mean). 0 turns this off.
The kernel sizes its split-KV grid from the launch's rows (a CUDA graph's, padding included;
`decode_splits`, the engine's rule): a launch that takes fewer splits than the profile's rows of B
sequences is priced at least at its longest program, from the one-sequence rows
(`DecodeAttentionPricing.time`).
"""
from __future__ import annotations

from collections.abc import Callable

from policies.block_table_width import table_tokens
from sim.latency.base import BatchShape
from sim.latency.operator_profile import OperatorProfile

# Decode kernels whose split-KV count follows kernels/decode_splits.py (the packed kernel's grid is fixed).
SPLIT_KERNELS = ("tma", "per-head")


class DecodeAttentionPricing:
    """One layer's decode attention of a step, from a profile's `decode_attention` rows at one
    GPU's share of the model (`width`: head_dim, num_kv_heads, group)."""

    def __init__(self, profile: OperatorProfile, width: dict[str, float], num_kv_heads: int,
                 decode_wave_programs: int, decode_splits: Callable[[int, int, int], int] | None,
                 max_model_len: int | None, block_size: int, kv_reread_cost: float) -> None:
        self.num_kv_heads = num_kv_heads
        self.decode_wave_programs = decode_wave_programs
        self.kv_reread_cost = kv_reread_cost
        self.decode = profile.grid("decode_attention").fixed(**width)
        kernels = {meta.get("kernels") for meta in profile.meta} - {None}
        self.split_rule = (decode_splits if decode_splits is not None and decode_wave_programs
                           and kernels & set(SPLIT_KERNELS) else None)
        if self.split_rule is not None:
            widths = [int(meta["decode_block_table_tokens"]) for meta in profile.meta
                      if "decode_block_table_tokens" in meta]
            # The engine's block tables: max_model_len's blocks at the width rule's columns.
            self.table_tokens = (table_tokens(max_model_len, block_size) if max_model_len
                                 else widths[0] if widths else 0)
            # The profile's one-sequence rows: Hkv programs, split as the kernel splits them.
            self.lone_splits = self.split_rule(num_kv_heads, decode_wave_programs,
                                               widths[0] if widths else self.table_tokens)
            self._launch_splits: dict[int, int] = {}

    @property
    def splits_by_launch(self) -> bool:
        """Whether the time depends on the launch's rows (the kernel's split rule is known)."""
        return self.split_rule is not None

    def time(self, s: BatchShape, launch: int) -> float:
        """One layer's decode attention: the profile's time at the batch and `decode_context`, at least the
        time of the launch's longest program. The kernel sizes its split-KV grid from the launch's
        rows (`launch`: a graph's, padding included: a token graph launches min(tokens,
        max_num_seqs) decode rows whatever decodes the step holds; read only where
        `splits_by_launch`), so a step whose launch takes fewer splits than its decodes alone would
        runs each over a longer stretch of context. One program's time over c / s tokens is the
        one-sequence rows' (Hkv programs of `lone_splits` splits each) at c x lone_splits / s."""
        n = s.num_decode_seqs
        t = self.decode(n, self.decode_context(s))
        if self.split_rule is None:
            return t
        splits = self._launch_splits.get(launch)
        if splits is None:
            splits = self._launch_splits[launch] = self.split_rule(
                launch * self.num_kv_heads, self.decode_wave_programs, self.table_tokens)
        longest = s.max_context_tokens or s.num_context_tokens / n
        return max(t, self.decode(1, longest * self.lone_splits / splits))

    def decode_context(self, s: BatchShape) -> float:
        """The per-sequence context decode attention is priced at: the mean (shared entries at
        `kv_reread_cost`, `BatchShape.kv_read_tokens`), moved towards the longest by the idle
        fraction of the kernel's wave."""
        mean = max(s.kv_read_tokens(self.kv_reread_cost) / s.num_decode_seqs, 1.0)
        if not self.decode_wave_programs or s.max_context_tokens <= mean:
            return mean
        idle = 1.0 - s.num_decode_seqs * self.num_kv_heads / self.decode_wave_programs
        return mean + idle * (s.max_context_tokens - mean) if idle > 0 else mean
