"""The `LatencyModel` interface: how long the backend takes for one scheduler step.

The simulator calls `step_time(out)` before `scheduler.update`, so each scheduled sequence still
holds its pre-step `num_computed_tokens` (c) and computes `num_new_tokens` (q) tokens at positions
[c, c + q). A step with q == 1 is a decode (it reads c + 1 KV entries); q > 1 is a prefill chunk
(possibly over a cached or earlier-computed prefix of c tokens). `swap_time(n)` is the cost of
moving n KV blocks over the host link; recompute costs nothing extra here because the scheduler
re-schedules the recomputed tokens as prefill, which `step_time` prices.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, itemgetter

from policies.outputs import SchedulerOutput
from policies.request import is_int
from policies.sequence import Sequence


@dataclass(slots=True)
class BatchShape:
    """What a latency model needs to know about a step, computed in one pass over `scheduled`."""

    num_prefill_tokens: int = 0  # new tokens of chunks with q > 1
    num_prefill_seqs: int = 0
    prefill_context_tokens: int = 0  # sum of c over prefill chunks (cached/earlier prefix read)
    prefill_attention_pairs: int = 0  # sum of q*c + q*(q+1)/2: (query, key) pairs of causal attention
    num_decode_seqs: int = 0
    num_context_tokens: int = 0  # sum of c + 1 over decodes: KV entries the decodes read
    num_samples: int = 0  # tokens sampled (LM head rows)
    num_copies: int = 0  # copy-on-write block copies
    prefill_chunks: tuple[tuple[int, int], ...] = ()  # (q, c) of each prefill chunk
    # c + 1 of the longest decode (0: not computed): a program-per-sequence decode kernel's time on a
    # small batch follows it rather than num_context_tokens.
    max_context_tokens: int = 0
    # KV entries of the decodes that another decode of the batch reads too (0: not computed): the
    # entries of every physical block a decode's block table shares with an earlier decode's (a
    # cached prefix, a forked prompt). The attention kernel reads such a block from HBM once and
    # the other sequences' reads hit L2 (`Hardware.kv_reread_cost`).
    num_shared_context_tokens: int = 0

    def kv_read_tokens(self, reread_cost: float) -> float:
        """The decodes' KV entries as fresh HBM reads: every entry once, the shared re-reads at
        `reread_cost` of a fresh one."""
        if not self.num_shared_context_tokens:
            return self.num_context_tokens
        return self.num_context_tokens - (1.0 - reread_cost) * self.num_shared_context_tokens

    @classmethod
    def of(cls, out: SchedulerOutput, longest: bool = False, block_size: int = 0) -> BatchShape:
        """`longest`: also find the longest decode context (one more pass over a decode-only batch);
        `block_size` > 0: also count the decodes' shared KV entries (`shared_context_tokens`)."""
        shape = cls._of(out, longest)
        if block_size and shape.num_decode_seqs > 1:
            decodes = out.scheduled if not shape.num_prefill_seqs else [s for s in out.scheduled if s[1] == 1]
            shape.num_shared_context_tokens = shared_context_tokens(map(_seq, decodes), block_size)
        return shape

    @classmethod
    def _of(cls, out: SchedulerOutput, longest: bool) -> BatchShape:
        scheduled = out.scheduled
        n = len(scheduled)
        # This runs every simulated step: the totals come from the scheduler (or run in C, with map
        # and attrgetter), and only prefill chunks, usually few, are visited in Python.
        new, computed, samples = out.sum_new_tokens, out.sum_computed_tokens, out.sum_samples
        if new is None or computed is None or samples is None:
            new = sum(map(_num_new, scheduled))
            computed = sum(map(_computed, scheduled))
            samples = sum(map(_num_samples, scheduled))
        if new == n:  # every entry computes one token: all decodes
            longest_c = max(map(_computed, scheduled)) + 1 if longest and n else 0
            return cls(0, 0, 0, 0, n, computed + n, samples, len(out.copy), (), longest_c)
        p_tokens = p_ctx = p_pairs = p_seqs = longest_c = 0
        chunks = []
        for seq, q, _ in scheduled:
            c = seq.num_computed_tokens
            if q > 1:
                p_seqs += 1
                p_tokens += q
                p_ctx += c
                p_pairs += q * c + (q * (q + 1) >> 1)
                chunks.append((q, c))
            elif c >= longest_c:
                longest_c = c + 1
        d_seqs = n - p_seqs
        return cls(p_tokens, p_seqs, p_ctx, p_pairs, d_seqs, computed - p_ctx + d_seqs, samples, len(out.copy),
                   tuple(chunks), longest_c)


def shared_context_tokens(seqs: Iterable[Sequence], block_size: int) -> int:
    """KV entries the sequences' block tables hold in a physical block that an earlier sequence's
    table holds too: the re-reads of a batch that reads every sequence's whole table. Shared blocks
    are full (a cached prefix, or a forked prompt's blocks), so each counts `block_size` entries.
    A shared run starts at the tables' first block (a prefix hit is a chain from the first block, a
    fork copies the whole table), so a batch whose first blocks all differ shares nothing and is not
    walked further: the common case costs one pass over the first blocks."""
    tables = list(map(_block_table, seqs))  # a decode holds at least the block it writes
    if len(set(map(_first, tables))) == len(tables):
        return 0
    return (sum(map(len, tables)) - len(set(chain.from_iterable(tables)))) * block_size


_seq = _first = itemgetter(0)
_block_table = attrgetter("block_table")
_computed = attrgetter("seq.num_computed_tokens")
_num_new = itemgetter(1)
_num_samples = itemgetter(2)


def check_block_size(block_size: object) -> int:
    """A latency model's `block_size`: an integer >= 1, or ValueError naming it."""
    if not is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} is invalid: must be an integer >= 1")
    return block_size


class LatencyModel(ABC):
    name: str = "base"
    # Whether the model prices the engine's sequence-parallel steps (`parallel.sequence_parallel_min_rows`
    # > 0 at N > 1 GPUs); a model without is refused such a run (sim/latency/build.py).
    prices_sequence_parallel: bool = False

    @abstractmethod
    def step_time(self, out: SchedulerOutput) -> float:
        """Seconds the forward of `out.scheduled` (plus its copy-on-write copies) takes."""

    @abstractmethod
    def swap_time(self, num_blocks: int) -> float:
        """Seconds to move `num_blocks` KV blocks between GPU and CPU (0 for 0 blocks)."""

    # Whether step prices follow the longest decode context (`BatchShape.max_context_tokens`): the
    # simulator then passes it to `decode_times`.
    uses_longest_context: bool = False
    # Host seconds the engine spends admitting one request (`LLMEngine.add_request`), paid one request
    # after another before the scheduler sees them (sim/simulator.py); 0: not modelled.
    admission_s: float = 0.0

    # The fraction of a fresh KV read's cost that a decode pays to re-read a block another decode of
    # the batch reads (`BatchShape.num_shared_context_tokens`); 1.0: re-reads priced as fresh reads,
    # and the simulator does not count shared blocks.
    kv_reread_cost: float = 1.0
    _shared_block_size: int = 0

    def set_reread_cost(self, kv_reread_cost: float, block_size: int) -> None:
        """Price re-reads of shared KV blocks (of `block_size` tokens) at `kv_reread_cost` of a fresh
        read (`Hardware.kv_reread_cost`); `_shared_block_size` is the block size `BatchShape.of` counts
        shared entries with, 0 when they cost a fresh read. Every model passes its block size through
        here, which checks it."""
        check_block_size(block_size)
        if isinstance(kv_reread_cost, bool) or not isinstance(kv_reread_cost, (int, float)) \
                or not 0 <= kv_reread_cost <= 1:
            raise ValueError(f"kv_reread_cost={kv_reread_cost!r} is invalid: must be a number in [0, 1]")
        self.kv_reread_cost = float(kv_reread_cost)
        self._shared_block_size = block_size if self.prices_shared_reads else 0

    def shared_context_tokens(self, seqs: Iterable[Sequence]) -> int:
        """`shared_context_tokens` of decodes `seqs` at the block size the model counts them with
        (0 where re-reads cost a fresh read)."""
        return shared_context_tokens(seqs, self._shared_block_size) if self._shared_block_size else 0

    @property
    def prices_shared_reads(self) -> bool:
        """Whether step prices depend on the batch's shared KV blocks: the simulator then counts them
        (`BatchShape.of(block_size=...)`, `decode_times(num_shared_context_tokens=...)`)."""
        return self.kv_reread_cost < 1.0

    def data_sources(self) -> dict[str, str]:
        """What the prices rest on, by part (e.g. "compute", "collectives"), one line each, for a
        run's summary; empty where the config says it all."""
        return {}

    def decode_times(self, num_seqs: int, num_context_tokens: int, num_samples: int,
                     num_steps: int, max_context_tokens: int = 0,
                     num_shared_context_tokens: int = 0) -> list[float] | None:
        """Step times of `num_steps` consecutive decode-only steps of one batch, each equal to
        `step_time` of that step's output: step s runs `num_seqs` decodes (no copies) reading
        `num_context_tokens + s * num_seqs` KV entries, the longest `max_context_tokens + s` (0: not
        given), `num_shared_context_tokens` of them re-reads of blocks another decode reads (the same
        every step: new tokens go to private blocks), and sampling `num_samples` tokens. None (the
        default) when the model cannot tell without the outputs: the simulator then steps one by one."""
        return None

    def total_time(self, out: SchedulerOutput) -> float:
        """Step time plus the swap-out and swap-in transfers the backend runs before the forward."""
        t = self.step_time(out)
        if out.swap_out:
            t += self.swap_time(len(out.swap_out))
        if out.swap_in:
            t += self.swap_time(len(out.swap_in))
        return t


def shape_decode_times(shape_time: Callable[[BatchShape], float], num_seqs: int, num_context_tokens: int,
                       num_samples: int, num_steps: int, max_context_tokens: int = 0,
                       num_shared_context_tokens: int = 0) -> list[float]:
    """`LatencyModel.decode_times` for a model that prices a `BatchShape` (`shape_time`)."""
    end = num_context_tokens + num_steps * num_seqs
    grow = 1 if max_context_tokens else 0
    return [shape_time(BatchShape(0, 0, 0, 0, num_seqs, context, num_samples, 0, (), max_context_tokens + s * grow,
                                  num_shared_context_tokens))
            for s, context in enumerate(range(num_context_tokens, end, num_seqs))]
