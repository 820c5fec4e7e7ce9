"""FastServe's skip-join multi-level feedback queue (Wu et al., 2023), in tokens.

Level i (0 = most urgent) has a quantum of `base_quantum * growth**i` output tokens. A request
*skip-joins*: it enters at the most urgent level whose quantum covers its prefill, counting each
prompt token as `prompt_token_cost` output tokens (a long prompt skips the top levels, where its
prefill alone would use up the quantum). A sequence that generates a level's quantum of tokens is
demoted to the next level (the last level keeps it). Within a level, first come first served.

The level falls as a running sequence generates tokens, so the running queue is declared in
`reorders`. With `preempt_running` (default) the waiting head forces out running sequences of a
less urgent level when it cannot be admitted: preemption at token granularity, as FastServe's
iteration-level preemption. FastServe's starvation guard (promoting long-waiting jobs) is left out:
demotion bounds what a long job can take from short ones, not the other way round.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection
from dataclasses import dataclass
from itertools import accumulate

from policies.policy.base import OrderHint, Policy, PolicyConfig, register_policy
from policies.queues import SchedulerQueues
from policies.sequence import Sequence

INF = float("inf")
PRUNE_MIN = 1024  # kept keys before the first pruning


def _positive(name: str, value: float, integer: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float)) and 0 < value < float("inf")
    if not ok:
        kind = "an integer >= 1" if integer else "a finite number > 0"
        raise ValueError(f"{name}={value!r} is invalid: must be {kind}")


@dataclass(kw_only=True)
class MLFQConfig(PolicyConfig):
    num_levels: int = 6
    base_quantum: int = 32  # output tokens at level 0; level i has base_quantum * growth**i
    growth: float = 2.0
    prompt_token_cost: float = 0.0625  # a prompt token's cost in output tokens, for the entry level
    preempt_running: bool = True  # a more urgent waiting head may force out running sequences


@register_policy("mlfq", config=MLFQConfig)
class SkipJoinMLFQPolicy(Policy):
    reorders = frozenset({"running"})
    may_preempt_suffix = True

    def __init__(self, preemption_mode: str = "recompute", num_levels: int = 6, base_quantum: int = 32,
                 growth: float = 2.0, prompt_token_cost: float = 0.0625, preempt_running: bool = True) -> None:
        super().__init__(preemption_mode)
        _positive("num_levels", num_levels, integer=True)
        _positive("base_quantum", base_quantum, integer=True)
        _positive("growth", growth)
        if growth < 1:
            raise ValueError(f"growth={growth!r} is invalid: must be >= 1 (quanta grow with the level)")
        if isinstance(prompt_token_cost, bool) or not isinstance(prompt_token_cost, (int, float)) \
                or not 0 <= prompt_token_cost < float("inf"):
            raise ValueError(f"prompt_token_cost={prompt_token_cost!r} is invalid: must be a finite number >= 0")
        if type(preempt_running) is not bool:
            raise ValueError(f"preempt_running={preempt_running!r} is invalid: must be True or False")
        self.quanta = [base_quantum * growth ** i for i in range(num_levels)]
        self.prompt_token_cost = float(prompt_token_cost)
        self.preempt_running = preempt_running
        # Per entry level: generated-token counts at which the sequence is demoted again.
        self._demotions = [list(accumulate(self.quanta[start:-1])) for start in range(num_levels)]
        # The key is read for every running sequence each step but changes only at a demotion: each
        # sequence's key is kept with the token count at which its level next changes. Entries of
        # sequences that left the queues are dropped by `refresh` once they outnumber the live ones.
        self._keys: dict[Sequence, tuple[float, tuple]] = {}
        self._prune_at = PRUNE_MIN

    def entry_level(self, seq: Sequence) -> int:
        """Skip-join: the most urgent level whose quantum covers the prefill."""
        cost = seq.num_prompt_tokens * self.prompt_token_cost
        return min(bisect_right(self.quanta, cost) if cost > self.quanta[0] else 0, len(self.quanta) - 1)

    def level(self, seq: Sequence) -> int:
        return self.key(seq)[0]

    def key(self, seq: Sequence) -> tuple:
        kept = self._keys.get(seq)
        if kept is not None and len(seq.token_ids) < kept[0]:
            return kept[1]
        num_prompt = seq.num_prompt_tokens
        start = self.entry_level(seq)
        demotions = self._demotions[start]
        passed = bisect_right(demotions, len(seq.token_ids) - num_prompt)
        key = (start + passed, seq.request.arrival_time, seq.arrival_index, seq.seq_id)
        self._keys[seq] = (num_prompt + demotions[passed] if passed < len(demotions) else INF, key)
        return key

    def refresh(self, queues: SchedulerQueues, hint: OrderHint) -> Collection[str]:
        if len(self._keys) > self._prune_at:
            live = [seq for queue in (queues.waiting, queues.running, queues.swapped) for seq in queue]
            keys = self._keys
            self._keys = {seq: keys[seq] for seq in live if seq in keys}
            self._prune_at = max(PRUNE_MIN, 2 * len(live))
        return self.reorders

    def may_preempt(self, waiting: Sequence, running: Sequence) -> bool:
        return self.preempt_running and self.key(waiting)[0] < self.key(running)[0]
