"""The `BlockManager` interface: where each sequence's KV cache lives.

Block tables are lists of physical GPU block ids (`seq.block_table`); token position p of a
sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.
While a sequence is SWAPPED its `block_table` holds CPU block ids.
Implementations: `paged` (PagedAttention), `prefix` (paged + automatic prefix caching),
`contiguous` (the pre-PagedAttention reservation baseline).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, fields

from policies.registry import Registry, check_arguments
from policies.sequence import Sequence


class AllocStatus(enum.Enum):
    OK = "ok"  # can be allocated now
    LATER = "later"  # not now (pool busy / watermark), maybe after others finish
    NEVER = "never"  # can never fit in the GPU pool: the request is aborted as too_long


def admission_status(needed: int, num_free: int, num_gpu_blocks: int, watermark_blocks: int) -> AllocStatus:
    """The admission rule for a sequence that needs `needed` more GPU blocks to be admitted or
    swapped in: NEVER past the whole pool; LATER while it would leave fewer than `watermark_blocks`
    free in a pool that other sequences hold blocks of (headroom for their decodes); else OK.
    An idle pool takes any sequence that fits it, so whether a request can ever run depends on its
    length alone (`fits_idle_pool`), never on whether it was preempted or how steps were cut."""
    if needed > num_gpu_blocks:
        return AllocStatus.NEVER
    if num_free - needed < watermark_blocks and num_free < num_gpu_blocks:
        return AllocStatus.LATER
    return AllocStatus.OK


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """The blocks of `block_size` tokens that `num_tokens` tokens take."""
    return -(-num_tokens // block_size)


def fits_idle_pool(num_tokens: int, block_size: int, num_gpu_blocks: int) -> bool:
    """Whether a sequence of `num_tokens` tokens at its longest can ever run: its blocks fit the pool,
    so `admission_status` admits it once the pool is idle. Admission aborts a request that fails it as
    too_long; the start-up size check (policies/kv_pool_size.py `check_holds_one_sequence`) asks it
    for one max_model_len request."""
    return blocks_for_tokens(num_tokens, block_size) <= num_gpu_blocks


@dataclass(slots=True)
class BlockUsage:
    gpu_used: int
    gpu_total: int
    cpu_used: int
    cpu_total: int
    prefix_hits: int = 0  # prefix caching: blocks found in cache (cumulative)
    prefix_queries: int = 0  # prefix caching: full blocks looked up (cumulative)


BLOCK_MANAGERS: Registry[type[BlockManager]] = Registry("block manager", field="kind", group="blocks")


@dataclass(kw_only=True)
class BlockManagerConfig:
    """conf/blocks/<kind>.yaml: the KV pool's size and admission headroom, which every block manager
    has. A block manager with knobs of its own subclasses this and takes them as keyword arguments
    of its constructor (`own_knobs`)."""

    kind: str | None = None  # the registered name
    block_size: int | None = 16  # tokens per block (power of two)
    # GPU KV blocks: an explicit count, else kv_cache_gib of KV memory, else as vLLM derives it.
    num_gpu_blocks: int | None = None
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float | None = 0.9
    # CPU swap pool: an explicit count, else swap_space_gib of pinned host memory.
    num_cpu_blocks: int | None = None
    swap_space_gib: float | None = 4.0
    watermark: float | None = 0.01  # fraction of GPU blocks kept free at admission


BASE_KNOBS = frozenset(f.name for f in fields(BlockManagerConfig))


def own_knobs(config: BlockManagerConfig) -> dict[str, object]:
    """The knobs a block manager's config adds to `BlockManagerConfig`, as constructor keywords."""
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name not in BASE_KNOBS}


def register_block_manager(name: str, config: type[BlockManagerConfig] = BlockManagerConfig
                           ) -> Callable[[type[BlockManager]], type[BlockManager]]:
    """Register a block manager under `name` with its config dataclass; the config's own knobs
    (beyond `BlockManagerConfig`'s) must be keyword arguments of its constructor (checked here)."""
    register = BLOCK_MANAGERS.register(name, config=config)

    def wrap(cls: type[BlockManager]) -> type[BlockManager]:
        check_arguments(cls, config, exclude=BASE_KNOBS)
        return register(cls)
    return wrap


class BlockManager(ABC):
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, max_model_len: int | None = None) -> None:
        if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size!r} is invalid: must be a power of two >= 1")
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks={num_gpu_blocks!r} is invalid: must be an integer >= 1")
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks={num_cpu_blocks!r} is invalid: must be an integer >= 0")
        if not isinstance(watermark, (int, float)) or isinstance(watermark, bool) or not 0 <= watermark < 1:
            raise ValueError(f"watermark={watermark!r} is invalid: must be a number in [0, 1)")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
            raise ValueError(f"max_model_len={max_model_len!r} is invalid: must be None or an integer >= 1")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.max_model_len = max_model_len

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def max_seq_tokens(self, seq: Sequence) -> int:
        """Tokens a sequence can hold at its longest: min(prompt + max_tokens, max_model_len)."""
        limit = seq.num_prompt_tokens + seq.request.sampling_params.max_tokens
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len)
        return max(limit, seq.num_tokens)

    @abstractmethod
    def can_allocate(self, seq: Sequence) -> AllocStatus:
        """Whether `allocate(seq)` can place all of seq's current tokens (a WAITING sequence)."""

    @abstractmethod
    def allocate(self, seq: Sequence) -> None:
        """Give a WAITING sequence blocks for all its current tokens. `prefix` may also advance
        `seq.num_computed_tokens` over cached blocks (always leaving >= 1 token to compute)."""

    @abstractmethod
    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether slots for positions < num_computed_tokens + num_new_tokens can be provided.
        A decode (num_new_tokens=1) never needs more than one free GPU block, so it is True
        whenever `num_free_gpu_blocks() >= 1` (contiguous: always, within the reservation)."""

    @abstractmethod
    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Ensure those slots exist and are owned by seq alone; returns (src, dst) block copies the
        backend must run before the forward (copy-on-write; contiguous: the fork copies). Call it for
        every chunk the forward writes, and do not free or swap out seq later in the same step."""

    def append_decode_slots(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        """`append_slots(seq, 1)` for every seq of a decode batch, all or nothing: returns the copies,
        or None without changing anything when they might not all fit (then go seq by seq and
        preempt). One call instead of 2 per sequence: use it on the hot path."""
        if not self.decode_slots_fit(seqs):
            return None
        copies: list[tuple[int, int]] = []
        for seq in seqs:
            copies.extend(self.append_slots(seq, 1))
        return copies

    def decode_slots_fit(self, seqs: list[Sequence], ahead: int = 0) -> bool:
        """Whether `append_decode_slots(seqs)` surely succeeds once each seq has computed `ahead`
        more tokens (0 or 1; with fewer seqs or more free blocks by then, too): the check at its top."""
        return self.num_free_gpu_blocks() >= len(seqs)

    def decode_run_limit(self, seqs: list[Sequence], max_steps: int) -> int:
        """How many consecutive decode steps of exactly `seqs` (each computes one token per step),
        at most `max_steps`, `append_decode_slots` serves with no copy and no shortage: the steps
        `append_decode_run` may then apply at once (the scheduler's fast-forward). 0, the default,
        when the manager cannot tell without running them."""
        return 0

    def append_decode_run(self, seqs: list[Sequence], num_steps: int) -> list[int]:
        """What `num_steps` such decode steps do to the blocks, in their order: per step
        `append_decode_slots(seqs)`, then every seq advances one token and `mark_computed` runs for
        those that filled a block. Advances each `seq.num_computed_tokens` by `num_steps`; returns
        the GPU blocks used after each step. Only for steps `decode_run_limit` allowed."""
        marks = type(self).mark_computed is not BlockManager.mark_computed
        mask = self.block_size - 1
        used = []
        for _ in range(num_steps):
            if self.append_decode_slots(seqs) != []:
                raise RuntimeError("append_decode_run went past decode_run_limit: a step needs copies "
                                   "or lacks blocks")
            for seq in seqs:
                seq.num_computed_tokens += 1
                if marks and not seq.num_computed_tokens & mask:
                    self.mark_computed(seq)
            used.append(self.usage().gpu_used)
        return used

    @abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares all of parent's blocks (ref counts +1). Contiguous (nothing shared): the child
        gets a run reserved at the parent's admission, and the copies of the parent's computed
        blocks come out of the child's next `append_slots`; until then it cannot be swapped out."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (GPU or CPU, whichever it holds); empties its block table."""

    @abstractmethod
    def can_swap_out(self, seq: Sequence) -> bool: ...

    @abstractmethod
    def swap_out(self, seq: Sequence) -> dict[int, int]:
        """Move a RUNNING sequence's blocks to the CPU pool; returns {gpu_block: cpu_block} copies
        (blocks already copied for a sibling are shared, not copied again). Within one step, plan
        swap-outs before swap-ins (the backend runs them in that order)."""

    @abstractmethod
    def can_swap_in(self, seq: Sequence) -> AllocStatus: ...

    @abstractmethod
    def swap_in(self, seq: Sequence) -> dict[int, int]:
        """Move a SWAPPED sequence back; returns {cpu_block: gpu_block}."""

    def mark_computed(self, seq: Sequence) -> None:
        """Called after a step for each scheduled sequence whose chunk was a prefill (more than one
        token), whose decode filled a block (num_computed_tokens % block_size == 0), or in any step
        that ran block copies; skipped for the other decodes, where nothing new became computed
        (prefix caching registers the full blocks that are now computed). No-op by default."""

    @abstractmethod
    def num_free_gpu_blocks(self) -> int: ...

    @abstractmethod
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless, given ALL live sequences (those holding or waiting for blocks):
        ref counts equal block-table references (plus the manager's own holds), free + used == total
        in each pool, and blocks are shared only by forked siblings (or through the prefix cache).
        O(blocks + table entries): meant for tests, after every scheduler step."""

    @abstractmethod
    def usage(self) -> BlockUsage: ...

    def cached_block_hashes(self) -> AbstractSet[int]:
        """The chained hashes (policies/blocks/prefix.py:block_hash) of the full blocks a request's
        prompt could be served from, a live view; empty without prefix caching. Routers read it."""
        return frozenset()
