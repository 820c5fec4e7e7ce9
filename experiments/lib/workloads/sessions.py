"""Multi-turn sessions (`kind: sessions`): conversations whose every turn resends the conversation.

Sessions start as a Poisson stream at `rate` sessions/s; a session has `turns` turns (a length
distribution, synthetic.py's forms) and its turns arrive `think_time_s` apart on average
(exponential gaps; open loop: a turn does not wait for the previous answer). Turn j's prompt is the
session's system prompt (`system_prompts`, prefixes.py; none by default), then every earlier turn's
user text and answer, then its own user text (`prompt_len` tokens); its output is `output_len`
tokens. The answer put into the next prompts is drawn token ids of that length, not what a model
generated (which a workload cannot know), so a prefix cache serves a turn the earlier prompts but
recomputes the earlier answers. A session ends early before a turn whose prompt would exceed
`max_prompt_len` (null: no limit; one that no session's first prompt fits in is an error, not an
empty workload); `num_requests` (null: all) keeps the first turns by arrival time. Requests are
`s<k>-t<j>` with `session_id` `s<k>`; everything is drawn from the run's seed.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from experiments.lib.workloads.base import WORKLOADS, Workload, WorkloadConfig
from experiments.lib.workloads.common import (
    COUNT,
    LENGTH,
    MAX_REQUESTS,
    PromptMemory,
    get_int,
    is_num,
    make_request,
)
from experiments.lib.workloads.prefixes import SystemPrompts, SystemPromptsSpec
from experiments.lib.workloads.synthetic import LengthDist, arrival_times, lengths


@dataclass(kw_only=True)
class SessionsWorkloadConfig(WorkloadConfig):
    num_sessions: int | None = None
    turns: LengthDist | None = None
    think_time_s: float | None = None
    prompt_len: LengthDist | None = None
    output_len: LengthDist | None = None
    max_prompt_len: int | None = None
    max_tokens: int | None = None
    system_prompts: SystemPromptsSpec | None = None
    vocab_size: int | None = None


@WORKLOADS.register("sessions", config=SessionsWorkloadConfig)
def build(cfg: Mapping[str, Any], seed: int, vocab_size: int, where: str = "workload") -> Workload:
    n = get_int(cfg, "num_sessions", where, 1, COUNT)
    think = cfg.get("think_time_s", 0.0)
    if not is_num(think) or not 0 <= think < float("inf"):
        raise ValueError(f"{where}.think_time_s={think!r} is invalid: must be a finite number >= 0")
    limit = get_int(cfg, "max_prompt_len", where, 1, LENGTH) if cfg.get("max_prompt_len") is not None else None
    max_tokens = get_int(cfg, "max_tokens", where, 1, LENGTH) if cfg.get("max_tokens") is not None else None
    high = min(get_int(cfg, "vocab_size", where), vocab_size)
    keep = get_int(cfg, "num_requests", where, 1, COUNT) if cfg.get("num_requests") is not None else None
    rng = np.random.default_rng(seed)
    starts = arrival_times({"arrival": "poisson", "rate": cfg.get("rate")}, n, rng, where)
    turns = lengths(cfg.get("turns"), n, rng, f"{where}.turns", COUNT)
    system = SystemPrompts.from_spec(cfg.get("system_prompts"), rng, high, f"{where}.system_prompts")
    picks = system.draw(n, rng) if system is not None else [None] * n
    system_len = len(system.prompts[0]) if system is not None else 0
    total = int(turns.sum())
    if total > MAX_REQUESTS:
        raise ValueError(f"{where}.turns: the {n:,} sessions' turns come to {total:,} requests, more than the "
                         f"{MAX_REQUESTS:,} a workload may hold: lower {where}.num_sessions or the turns")
    users = lengths(cfg.get("prompt_len"), total, rng, f"{where}.prompt_len").tolist()
    answers = lengths(cfg.get("output_len"), total, rng, f"{where}.output_len").tolist()
    if max_tokens is not None:
        answers = [min(a, max_tokens) for a in answers]
    gaps = rng.exponential(think, size=total).tolist() if think > 0 else [0.0] * total
    # Which turns fit max_prompt_len, from the drawn lengths alone: the prompts' memory is checked
    # before any token id is drawn (a turn's prompt points at its earlier turns' ids: only its user
    # text and answer are drawn afresh). Per session: its turns that fit (time, user text, answer),
    # and the user text of the turn that did not (None: every turn fit).
    plan, k, tokens, drawn = [], 0, 0, 0
    for s in range(n):
        t, context, fits, refused = float(starts[s]), system_len, [], None
        for j in range(int(turns[s])):
            user, answer = users[k + j], answers[k + j]
            if j:
                t += gaps[k + j]
            if limit is not None and context + user > limit:
                refused = user
                break
            fits.append((t, user, answer))
            tokens += context + user
            drawn += user + answer
            context += user + answer
        plan.append((fits, refused))
        k += int(turns[s])
    if not any(fits for fits, _ in plan):  # every session ended before its first turn
        firsts = np.cumsum(turns) - turns  # each session's first turn's index in users
        user = min(users[int(k)] for k in firsts)
        part = f"{where}.system_prompts.len={system_len} plus " if system_len else ""
        raise ValueError(f"{where}.max_prompt_len={limit} is invalid: no session's first prompt fits in it (the "
                         f"shortest is {system_len + user} tokens: {part}{user} of {where}.prompt_len), so the "
                         "workload would hold no requests")
    system_ids = len(system.prompts) * system_len if system is not None else 0
    PromptMemory().add(tokens, drawn + system_ids, f"{where}.num_sessions={n}",
                       f"lower it, the turns or {where}.max_prompt_len")
    items = []
    for s, (fits, refused) in enumerate(plan):
        context = list(system.prompts[picks[s]]) if system is not None else []
        for j, (t, user, answer) in enumerate(fits):
            prompt = context + rng.integers(0, high, size=user).tolist()
            request = make_request(f"s{s}-t{j}", prompt, answer, max_tokens, t, 0)
            request.session_id = f"s{s}"
            items.append((t, s, j, request, answer))
            context = prompt + rng.integers(0, high, size=answer).tolist()
        if refused is not None:  # its user text is drawn too, as it always was: the stream stays the same
            rng.integers(0, high, size=refused)
    items.sort(key=lambda it: it[:3])
    if keep is not None:
        items = items[:keep]
    return Workload(str(cfg.get("name", "sessions")), [it[3] for it in items], [it[4] for it in items])
