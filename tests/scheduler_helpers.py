"""Test helpers for the scheduler: a builder and a fake backend that keeps a token-level KV store.

`KVStoreBackend.execute(out)` does what a real backend does, in the contract's order: swap_out,
swap_in, copy, then the forward, which first writes every scheduled token's "KV" (a fingerprint of
the tokens up to it) into its slot and then checks that every position each sequence attends to holds the right token. So any
block-management or ordering mistake (a shared block written in place, a swap planned in the wrong
order, a prefix hit on wrong contents, a block freed while still read) fails the read check.
"""
from __future__ import annotations

import random
from collections.abc import Callable

from policies import (
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    make_block_manager,
    make_policy,
)
from policies.policy.base import Policy


def make_scheduler(policy: str | type[Policy] = "fcfs", blocks: str = "paged", *, block_size: int = 4,
                   num_gpu_blocks: int = 16, num_cpu_blocks: int = 0, watermark: float = 0.0,
                   max_num_batched_tokens: int = 64, max_num_seqs: int = 8, max_model_len: int = 64,
                   chunked: bool = True, join_ahead: bool = True, **policy_kwargs) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, enable_chunked_prefill=chunked, join_ahead=join_ahead)
    manager = make_block_manager(blocks, block_size, num_gpu_blocks, num_cpu_blocks, watermark, max_model_len)
    made = make_policy(policy, **policy_kwargs) if isinstance(policy, str) else policy(**policy_kwargs)
    return Scheduler(config, made, manager)


def request(request_id: str, prompt_len: int, max_tokens: int = 4, *, arrival: float = 0.0,
            priority: int = 0, n: int = 1, first_token: int = 100, eos: int | None = None,
            **params) -> Request:
    prompt = list(range(first_token, first_token + prompt_len))
    return Request(request_id, prompt, SamplingParams(n=n, max_tokens=max_tokens, **params),
                   arrival_time=arrival, priority=priority, eos_token_id=eos)


def compact(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """`out.scheduled` as (request_id/sample_index, num_new_tokens, num_samples)."""
    return [(f"{e.seq.request.request_id}/{e.seq.sample_index}", e.num_new_tokens, e.num_samples)
            for e in out.scheduled]


class KVStoreBackend:
    """Slots hold `prefix_fingerprints` of the sequence that wrote them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.gpu: dict[int, list[int | None]] = {}
        self.cpu: dict[int, list[int | None]] = {}

    def _block(self, pool: dict[int, list[int | None]], block: int) -> list[int | None]:
        return pool.setdefault(block, [None] * self.block_size)

    def execute(self, out: SchedulerOutput) -> None:
        bs = self.block_size
        for gpu_block, cpu_block in out.swap_out.items():
            self.cpu[cpu_block] = list(self._block(self.gpu, gpu_block))
        for cpu_block, gpu_block in out.swap_in.items():
            self.gpu[gpu_block] = list(self._block(self.cpu, cpu_block))
        for src, dst in out.copy:
            self.gpu[dst] = list(self._block(self.gpu, src))
        kv = {seq.seq_id: prefix_fingerprints(seq.token_ids) for seq, _, _ in out.scheduled}
        for seq, num_new, _ in out.scheduled:  # write this step's KV ...
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
                self._block(self.gpu, seq.block_table[pos // bs])[pos % bs] = kv[seq.seq_id][pos]
        for seq, num_new, _ in out.scheduled:  # ... then attend over everything up to it
            expected = kv[seq.seq_id]
            for pos in range(seq.num_computed_tokens + num_new):
                held = self._block(self.gpu, seq.block_table[pos // bs])[pos % bs]
                assert held == expected[pos], (
                    f"seq {seq.seq_id} reads wrong KV at position {pos} (block table {seq.block_table})")


def prefix_fingerprints(token_ids: list[int]) -> list[int]:
    """A stand-in for K/V: position p's value depends on all tokens up to p, like real attention KV."""
    out, h = [], 0
    for token in token_ids:
        h = hash((h, token))
        out.append(h)
    return out


def sample_tokens(out: SchedulerOutput, token_fn: Callable[[], int]) -> dict[int, list[int]]:
    return {e.seq.seq_id: [token_fn() for _ in range(e.num_samples)] for e in out.scheduled if e.num_samples}


def run_to_end(scheduler: Scheduler, *, token_fn: Callable[[], int] | None = None, now: float = 0.0,
               dt: float = 1.0, max_steps: int = 1000, check: bool = True,
               backend: KVStoreBackend | None = None) -> list[SchedulerOutput]:
    """Step until nothing is left; returns every step's output (checked against a KV store)."""
    if token_fn is None:
        rng = random.Random(0)
        token_fn = lambda: rng.randint(1000, 2000)
    backend = backend or KVStoreBackend(scheduler.block_manager.block_size)
    outs = []
    while scheduler.has_unfinished():
        assert len(outs) < max_steps, "the scheduler made no progress"
        out = scheduler.schedule(now)
        backend.execute(out)
        now += dt
        scheduler.update(out, sample_tokens(out, token_fn), now)
        if check:
            scheduler.check_invariants()
        outs.append(out)
    return outs
