"""`SchedulerConfig`: the scheduler's batch budgets and limits (vLLM's names), validated at construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    # Backends schedule each step while the one before it runs (`Scheduler.schedule_ahead`, vLLM
    # v1's async scheduling); the scheduler's decisions are the same rules, one step earlier.
    async_scheduling: bool = False
    # Scheduling ahead, a sequence that joins the running queue holding its next input token (a
    # decode replica's received hand-off) joins the step after the one in flight instead of making
    # that step synchronous (policies/lookahead.py); false: it forces a synchronous step.
    join_ahead: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
        for name in ("enable_chunked_prefill", "async_scheduling", "join_ahead"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be True or False")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is invalid: without "
                             f"chunked prefill a whole prompt must fit in one step, so it must be >= "
                             f"max_model_len={self.max_model_len}")
