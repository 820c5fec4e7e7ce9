"""A replica's steps priced by the share of each its KV link carried bytes (sim/fleet/kv_messages.py):
the decode replica's by its incoming messages (`KVReceivePrice.busy_factor`), a prefill replica's
by its outgoing ones (`send_busy_factor`), one rule for both.

A step is priced as it starts, from the wire intervals known then (`add`: a message's turn on the
link to its last byte); a message that reaches the wire during the step is only known later, so
the next step pays the difference between the step's price at its whole share and what it was
charged (a replica that never steps again leaves that difference unpaid).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sim.latency.kv_receive import wire_share


@dataclass(slots=True)
class BusyLinkCharge:
    """One replica's link: its wire intervals since its last step started, and that step's
    (start, priced end, price, busy-link seconds charged)."""

    factor: Callable[[float], float]  # a step's price multiplier at a wire share
    wire: list[tuple[float, float]] = field(default_factory=list)
    last: tuple[float, float, float, float] | None = None

    def add(self, begin: float, end: float) -> None:
        """A message on the wire from `begin` to `end`."""
        self.wire.append((begin, end))

    def surcharge(self, now: float, step_s: float, ahead_s: float = 0.0) -> float:
        """The busy-link seconds of a step of price `step_s` starting at `now` (`ahead_s`: device
        work queued ahead of it, inside its window but not priced by the factor), plus what the
        last step owes for messages that reached the wire during it; may be negative (the caller
        floors the step's total surcharge at 0)."""
        owed = 0.0
        if self.last is not None:
            start, end, price, charged = self.last
            owed = (self.factor(wire_share(start, end, self.wire)) - 1.0) * price - charged
        self.wire[:] = [w for w in self.wire if w[1] > now]
        end = now + step_s + ahead_s
        charged = (self.factor(wire_share(now, end, self.wire)) - 1.0) * step_s
        self.last = (now, end, step_s, charged)
        return charged + owed
