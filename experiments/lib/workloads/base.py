"""`Workload` (a request stream and its natural output lengths) and the registry of workload
kinds, which the kinds' modules register with (experiments/lib/workloads/__init__.py imports them)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from policies.registry import Registry
from policies.request import Request

# What the runs read of each workload request, on both backends: its final output only (the engine
# then does no per-step output work, as LLM.generate; a simulated pair's front reads as it would).
READ_OUTPUT_KIND = "final_only"


@dataclass(kw_only=True)
class WorkloadConfig:
    """The keys every workload kind's yaml has; a kind's config subclasses it with its own."""

    name: str | None = None
    kind: str | None = None  # the registered kind
    num_requests: int | None = None
    rate: float | None = None  # requests per second (arrivals); null or > 0, unused by some kinds
    seed: int | None = None  # the run's seed unless set


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[Request]  # sorted by arrival time
    output_lens: list[int]

    def __post_init__(self) -> None:
        if len(self.requests) != len(self.output_lens):
            raise ValueError("Workload needs one output length per request")
        for request in self.requests:  # once here, not again as each run adds them to a scheduler
            request.validate(None)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def stop_lens(self) -> dict[str, int]:
        """Requests that must end before max_tokens: request_id -> output length."""
        return {r.request_id: n for r, n in zip(self.requests, self.output_lens)
                if n < r.sampling_params.max_tokens}

    def fresh(self) -> Workload:
        """An identical stream of new Request objects (runs mutate requests as they finish)."""
        reqs = [r.fresh_copy() for r in self.requests]
        return Workload(self.name, reqs, list(self.output_lens))

    def rows(self) -> list[dict[str, Any]]:
        return [{"request_id": r.request_id, "arrival_time": r.arrival_time,
                 "num_prompt_tokens": r.num_prompt_tokens, "output_len": n,
                 "max_tokens": r.sampling_params.max_tokens, "priority": r.priority, "tenant": r.tenant}
                for r, n in zip(self.requests, self.output_lens)]


# A workload kind is a builder `build(cfg, seed, vocab_size) -> Workload` registered with its config
# dataclass (the keys of its conf/workload yaml): `@WORKLOADS.register("name", config=NameWorkload)`.
Builder = Callable[[Mapping[str, Any], int, int], Workload]
WORKLOADS: Registry[Builder] = Registry("workload", field="kind", group="workload")
