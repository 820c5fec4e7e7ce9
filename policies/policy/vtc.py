"""Virtual Token Counter fair scheduling (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024).

Each tenant (`Request.tenant`; requests without one share the tenant None) has a counter of the
service it received: `input_weight` per prompt token computed and `output_weight` per output token
generated, divided by the tenant's share `weights[tenant]` (default 1), as the paper's service
function. Each step is charged the tokens it computes: a one-token prompt or a prompt's last token
is input (and its sample output) though it is scheduled like a decode; a recompute preemption
computes the prompt again and is charged again (the paper has no preemption; charging the work
done keeps the counters a measure of GPU time spent), prompt tokens read from the prefix cache are
not computed and not charged. The waiting queue is served from the
backlogged tenant with the smallest counter, its requests in arrival order; the same key orders the
running and swapped queues (the victim of a preemption is the latest request of the most-served
tenant). A tenant that returns (it had nothing waiting) has its counter lifted to at least the
smallest counter among the tenants that kept waiting, so that being idle earns no credit: it
competes from where the others are, not from where it left.

Service is counted for every step once it is decided (`observe`) and added to the counters when
the next step begins (`refresh`), so keys change only there; the queues are re-sorted only when the
tenants' order by counter changed. A fast-forwarded decode run (`observe_decode_run`) replays both
for each of its steps, with nothing waiting, so it leaves the counters that stepping would. A step
admits in the order the step began with: one tenant may be admitted several times in one step
before its counter catches up (the paper re-picks the tenant after every admission), which widens
the service bound by at most one step's token budget.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from policies.outputs import SchedulerOutput
from policies.policy.base import QUEUE_NAMES, OrderHint, Policy, PolicyConfig, register_policy
from policies.queues import SchedulerQueues
from policies.sequence import Sequence

ALL_QUEUES = frozenset(QUEUE_NAMES)


def _weight(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name}={value!r} is invalid: must be a finite number > 0")
    return float(value)


@dataclass(kw_only=True)
class VTCConfig(PolicyConfig):
    input_weight: float = 1.0  # service per prompt token
    output_weight: float = 2.0  # service per output token
    weights: dict[str, float] | None = None  # tenant -> share (default 1)


@register_policy("vtc", config=VTCConfig)
class VirtualTokenCounterPolicy(Policy):
    reorders = ALL_QUEUES

    def __init__(self, preemption_mode: str = "recompute", input_weight: float = 1.0, output_weight: float = 2.0,
                 weights: Mapping[str, float] | None = None) -> None:
        super().__init__(preemption_mode)
        self.input_weight = _weight("input_weight", input_weight)
        self.output_weight = _weight("output_weight", output_weight)
        self.weights = {str(t): _weight(f"weights.{t}", w) for t, w in (weights or {}).items()}
        self.counters: dict[str | None, float] = {}
        self._pending: dict[str | None, float] = {}  # service observed since the last refresh
        self._waiting_tenants: set[str | None] = set()
        self._ranking: tuple = ((), False)  # tenants by counter, and whether two counters tie
        # Per-tenant sequence counts of the running queue, for the version they were counted at.
        self._running_counts: tuple[int, dict[str | None, int]] = (-1, {})
        self._queues: SchedulerQueues | None = None

    def key(self, seq: Sequence) -> tuple:
        request = seq.request
        return (self.counters.get(request.tenant, 0.0), request.arrival_time, seq.arrival_index, seq.seq_id)

    def service(self, tenant: str | None) -> float:
        """The tenant's counter with the service observed since the last refresh."""
        return self.counters.get(tenant, 0.0) + self._pending.get(tenant, 0.0) / self.weights.get(tenant, 1.0)

    # ---- counting service -----------------------------------------------------------------------
    def _charge(self, tenant: str | None, tokens: float) -> None:
        self._pending[tenant] = self._pending.get(tenant, 0.0) + tokens

    def _running_tenants(self) -> dict[str | None, int]:
        queues = self._queues
        version, counts = self._running_counts
        if queues is None:
            return {}
        if version != queues.running_version:
            counts = {}
            for seq in queues.running:
                tenant = seq.request.tenant
                counts[tenant] = counts.get(tenant, 0) + 1
            self._running_counts = (queues.running_version, counts)
        return counts

    def observe(self, out: SchedulerOutput) -> None:
        queues, scheduled = self._queues, out.scheduled
        if out.decode_only and queues is not None and len(scheduled) == len(queues.running) == out.sum_samples:
            for tenant, count in self._running_tenants().items():  # steady decode: one output token each
                self._charge(tenant, self.output_weight * count)
            return
        w_in, w_out = self.input_weight, self.output_weight
        for seq, num_new, num_samples in scheduled:
            prompt = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens) - seq.num_computed_tokens
            self._charge(seq.request.tenant, w_in * max(prompt, 0) + w_out * num_samples)

    def observe_decode_run(self, running: list[Sequence], num_steps: int) -> Collection[str]:
        """Each step of the run begins as `refresh` with nothing waiting (a decode run has no waiting
        or swapped sequence), then charges one output token per running sequence: the counters, the
        tenants seen waiting and the ranking end as stepping leaves them. The ranking is taken at
        every step until one changes the order, and at the last (where stepping leaves it)."""
        counts: dict[str | None, int] = {}
        for seq in running:
            counts[seq.request.tenant] = counts.get(seq.request.tenant, 0) + 1
        charges = [(tenant, self.output_weight * count) for tenant, count in counts.items()]
        self._waiting_tenants = set()  # no tenant returns during the run: nothing is lifted
        changed: Collection[str] = ()
        for step in range(num_steps):
            self._fold()
            if not changed or step == num_steps - 1:
                changed = self._rank() or changed
            for tenant, tokens in charges:
                self._charge(tenant, tokens)
        return changed

    # ---- at each step -----------------------------------------------------------------------------
    def refresh(self, queues: SchedulerQueues, hint: OrderHint) -> Collection[str]:
        self._queues = queues
        return self._begin_step({seq.request.tenant for seq in queues.waiting}, self._running_tenants())

    def _begin_step(self, waiting: set[str | None], running: Collection[str | None]) -> Collection[str]:
        """`refresh`, given the tenants waiting and running: add the observed service to the
        counters, lift the returning tenants, and say which queues' order may have changed."""
        self._fold()
        counters = self.counters
        returning = waiting - self._waiting_tenants
        if returning:
            stayed = (self._waiting_tenants & waiting) or set(running)
            stayed -= returning
            if stayed:
                floor = min(counters.get(t, 0.0) for t in stayed)
                for tenant in returning:
                    counters[tenant] = max(counters.get(tenant, 0.0), floor)
        self._waiting_tenants = waiting
        return self._rank()

    def _fold(self) -> None:
        """Add the service observed since the last step began to the counters."""
        counters = self.counters
        for tenant, tokens in self._pending.items():
            counters[tenant] = counters.get(tenant, 0.0) + tokens / self.weights.get(tenant, 1.0)
        self._pending.clear()

    def _rank(self) -> Collection[str]:
        """The queues whose order may have changed since the last ranking."""
        # The queues' order changes only when the tenants' order by counter does; counters that tie
        # order requests by arrival across tenants, which the next change of counters may undo.
        ranking = sorted(self.counters.items(), key=lambda item: (item[1], str(item[0])))
        values = {value for _, value in ranking}
        order = (tuple(tenant for tenant, _ in ranking), len(values) != len(ranking))
        if order == self._ranking and not order[1]:
            return ()
        self._ranking = order
        return ALL_QUEUES
