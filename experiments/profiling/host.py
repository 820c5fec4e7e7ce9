"""Per-step host overhead of the real engine that `ModelRunner.execute` does not include: the
scheduler's `schedule(now)` + `update(out, tokens, now)` (with the trace recorder on, as in every
experiments run) and building the `{seq_id: tokens}` dict. Measured on a real `Scheduler` in the
state a step of the given shape runs in: D running decodes (all decoding: the scheduler's decode
fast path) plus, for P > 0, one waiting prompt of P tokens that the measured step admits.

This is pure CPU work, so it is measured separately from the GPU step and added to it (profile
column `host_s`); `time_s = forward_s + host_s` is the step period the engine loop pays.
"""
from __future__ import annotations

import random
import statistics
import time

from policies import (
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    TraceRecorder,
    make_block_manager,
    make_policy,
)

DECODE_PROMPT_LEN = 16
_PARAMS = SamplingParams(temperature=1.0, max_tokens=1 << 20, ignore_eos=True)


def _tokens(out) -> dict[int, list[int]]:
    return {s.seq.seq_id: [1] * s.num_samples for s in out.scheduled if s.num_samples}


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10000) for _ in range(n)]


def host_overhead(num_prefill_tokens: int, num_decode_seqs: int, block_size: int, repeats: int,
                  seed: int = 0) -> float:
    """Median seconds of schedule + update for a step with `num_decode_seqs` decodes and a new
    prompt of `num_prefill_tokens` tokens (0: a steady-state decode step)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is invalid: must be >= 1")
    rng = random.Random(seed)
    budget = num_prefill_tokens + num_decode_seqs + repeats + DECODE_PROMPT_LEN
    max_len = DECODE_PROMPT_LEN + num_prefill_tokens + 4 * repeats + 64
    blocks_per_seq = max_len // block_size + 2
    config = SchedulerConfig(max_num_batched_tokens=max(budget, DECODE_PROMPT_LEN * max(1, num_decode_seqs)),
                             max_num_seqs=num_decode_seqs + repeats + 1, max_model_len=max_len)
    blocks = make_block_manager("paged", block_size, (num_decode_seqs + repeats + 1) * blocks_per_seq, 0, 0.0,
                                max_len)
    sched = Scheduler(config, make_policy("fcfs"), blocks, TraceRecorder())
    now = 0.0
    for i in range(num_decode_seqs):
        sched.add(Request(f"d{i}", _prompt(rng, DECODE_PROMPT_LEN), _PARAMS, now), now)
    while sched.num_waiting:
        out = sched.schedule(now)
        sched.update(out, _tokens(out), now)
        now += 1e-3
    if num_decode_seqs:  # one plain decode step so every running sequence is decoding
        out = sched.schedule(now)
        sched.update(out, _tokens(out), now)
        now += 1e-3
    times = []
    for r in range(repeats):
        if num_prefill_tokens:
            sched.add(Request(f"p{r}", _prompt(rng, num_prefill_tokens), _PARAMS, now), now)
        t0 = time.perf_counter()
        out = sched.schedule(now)
        sched.update(out, _tokens(out), now)
        times.append(time.perf_counter() - t0)
        now += 1e-3
        got = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        if got != num_prefill_tokens:
            raise RuntimeError(f"host-overhead step scheduled {got} prefill tokens, "
                               f"expected {num_prefill_tokens}: the scheduler state is not what was built")
    return statistics.median(times)
