"""The trace recorder: every lifecycle event of every request, and one row per scheduler step.

The scheduler fires the events (it never measures time: `now` comes from the backend), so a
simulator run and an engine run of the same workload leave the same schema. Rows are plain dicts
(`REQUEST_COLUMNS`, `STEP_COLUMNS`); `experiments/` turns them into parquet files and a summary.

Request metrics follow vLLM's serving benchmark (docs/metrics.md): TTFT = first token - arrival,
E2E = finish - arrival, TPOT = (E2E - TTFT) / (output tokens of sample 0 - 1) (None for a single
token), queueing time = first scheduled - arrival, arrival = `request.arrival_time`. `token_times`
are the output token times of sample 0 (inter-token latencies are their differences); `output_len`
sums all samples. Rows appear in the order requests end.

Step rows: `time` is the schedule() clock, `duration` the update() clock minus it. A chunk is a
prefill when it starts with more than one token to compute, else a decode. `kv_tokens` is the sum of
`num_computed_tokens` over running sequences (token slots whose KV is written), so KV utilisation is
kv_tokens / (gpu_blocks_used * block_size); blocks shared by forked samples or the prefix cache
count once per sequence, so it can exceed 1. `num_swap_fallbacks` are also in
`num_preempted_recompute`; `prefix_hits` / `prefix_queries` are cumulative block counts.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from operator import itemgetter

from policies.request import Request
from policies.sequence import Sequence

REQUEST_COLUMNS = (
    "request_id", "tenant", "arrival_time", "priority", "prompt_len", "output_len", "n",
    "first_scheduled_time", "first_token_time", "finish_time", "num_preemptions", "num_swaps",
    "status", "finish_reason", "ttft", "tpot", "e2e", "queueing_time", "token_times",
)
STEP_COLUMNS = (
    "step", "time", "duration", "num_batched_tokens", "num_prefill_tokens", "num_prefill_seqs",
    "num_decode_seqs", "num_running", "num_waiting", "num_swapped", "gpu_blocks_used",
    "gpu_blocks_total", "cpu_blocks_used", "cpu_blocks_total", "kv_tokens", "num_swap_out_blocks",
    "num_swap_in_blocks", "num_copy_blocks", "num_preempted_recompute", "num_preempted_swap",
    "num_swap_fallbacks", "num_finished", "num_aborted", "prefix_hits", "prefix_queries",
)
EVENT_COLUMNS = ("time", "event", "request_id", "seq_id", "detail")
EVENTS = ("arrived", "scheduled", "first_token", "preempted", "swapped_out", "swapped_in",
          "finished", "aborted", "handed_off", "received")
PREEMPTION_EVENT_MODES = ("recompute", "swap", "recompute_fallback")


def request_row(request_id: str, arrival: float, priority: int, prompt_len: int, output_len: int, n: int,
                first_scheduled_time: float | None, first_token_time: float | None, finish_time: float,
                status: str, finish_reason: str | None, token_times: list[float], seq0_outputs: int,
                num_preemptions: int = 0, num_swaps: int = 0, tenant: str | None = None) -> dict:
    """One `REQUEST_COLUMNS` row, its latencies derived as the module docstring defines them (the
    scheduler's recorder and the serving benchmark's client both build rows here)."""
    ttft = None if first_token_time is None else first_token_time - arrival
    e2e = finish_time - arrival
    tpot = (e2e - ttft) / (seq0_outputs - 1) if ttft is not None and seq0_outputs > 1 else None
    queueing = None if first_scheduled_time is None else first_scheduled_time - arrival
    return {
        "request_id": request_id, "tenant": tenant, "arrival_time": arrival, "priority": priority,
        "prompt_len": prompt_len,
        "output_len": output_len, "n": n, "first_scheduled_time": first_scheduled_time,
        "first_token_time": first_token_time, "finish_time": finish_time, "num_preemptions": num_preemptions,
        "num_swaps": num_swaps, "status": status, "finish_reason": finish_reason, "ttft": ttft, "tpot": tpot,
        "e2e": e2e, "queueing_time": queueing, "token_times": token_times,
    }


@dataclass(slots=True)
class _Live:
    """What the recorder keeps about a request until it ends."""

    request: Request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    num_swaps: int = 0
    token_times: list[float] = field(default_factory=list)
    extra: dict | None = None  # columns beyond REQUEST_COLUMNS (a handed-off request's split)


@dataclass(slots=True)
class DecodeRunSteps:
    """The step rows of a fast-forwarded decode run (policies/decode_run.py), kept compact: step s of
    the run, from times[s] to times[s + 1], has `first`'s values except step (+ s), time, duration,
    gpu_blocks_used (gpu_used[s]), kv_tokens (+ s * num_seqs) and num_waiting (0, and
    `last_num_waiting` in the last step, for requests that arrived during it)."""

    first: dict
    times: list[float]
    gpu_used: list[int]
    num_seqs: int
    last_num_waiting: int

    def rows(self) -> list[dict]:
        columns: dict[str, list] = {name: [] for name in self.first}
        self.add_to(columns)
        names = list(columns)
        return [dict(zip(names, values)) for values in zip(*columns.values())]

    def add_to(self, columns: dict[str, list]) -> None:
        """Append the rows to `columns` (STEP_COLUMNS -> values) without building them."""
        times, num_steps, first = self.times, len(self.gpu_used), self.first
        varying = {
            "step": range(first["step"], first["step"] + num_steps), "time": times[:-1],
            "duration": [end - start for start, end in zip(times, islice(times, 1, None))],
            "gpu_blocks_used": self.gpu_used,
            "kv_tokens": range(first["kv_tokens"], first["kv_tokens"] + num_steps * self.num_seqs, self.num_seqs),
            "num_waiting": [0] * (num_steps - 1) + [self.last_num_waiting],
        }
        for name, values in columns.items():
            values.extend(varying[name] if name in varying else [first[name]] * num_steps)


class TraceRecorder:
    """Collects `requests` rows (one per ended request, in end order), `steps` rows (one per
    `Scheduler.update`, or per step of a fast-forwarded decode run) and, if `record_events`, the
    raw lifecycle `events` (tuples in `EVENT_COLUMNS` order; per-token times are kept in the
    request rows instead)."""

    def __init__(self, record_events: bool = True) -> None:
        self.record_events = record_events
        self.requests: list[dict] = []
        self.events: list[tuple] = []
        self._live: dict[str, _Live] = {}
        self._steps: list[dict] = []
        # Decode runs (and the rows after the first of them) whose rows are not built yet: a
        # simulated run of 10^5-10^6 steps is mostly decode runs, whose rows cost more to build and
        # hold than all the rest; `step_columns` writes them without ever building them.
        self._pending: list[dict | DecodeRunSteps] = []

    @property
    def steps(self) -> list[dict]:
        """One row per step, in step order (one list, which grows in place)."""
        if self._pending:
            for item in self._pending:
                if type(item) is DecodeRunSteps:
                    self._steps.extend(item.rows())
                else:
                    self._steps.append(item)
            self._pending.clear()
        return self._steps

    @property
    def has_compact_steps(self) -> bool:
        """Whether some step rows are still kept compact (decode runs), so `step_columns` is cheaper
        than building them for `steps`."""
        return bool(self._pending)

    def step_columns(self) -> dict[str, list]:
        """The step rows as columns (STEP_COLUMNS order), the same values as `steps`."""
        columns: dict[str, list] = {name: [] for name in STEP_COLUMNS}
        rows = list(self._steps)
        for item in self._pending:
            if type(item) is DecodeRunSteps:
                _add_rows(columns, rows)
                rows = []
                item.add_to(columns)
            else:
                rows.append(item)
        _add_rows(columns, rows)
        return columns

    def _event(self, now: float, event: str, request_id: str, seq_id: int | None, detail: str = "") -> None:
        if self.record_events:
            self.events.append((now, event, request_id, seq_id, detail))

    def arrived(self, request: Request, now: float) -> None:
        self._live[request.request_id] = _Live(request)
        self._event(now, "arrived", request.request_id, None)

    def scheduled(self, seq: Sequence, now: float) -> None:
        """A sequence was admitted; only the request's first admission is a lifecycle event."""
        live = self._live[seq.request.request_id]
        if live.first_scheduled_time is None:
            live.first_scheduled_time = now
            self._event(now, "scheduled", seq.request.request_id, seq.seq_id)

    def first_token(self, seq: Sequence, now: float) -> None:
        live = self._live[seq.request.request_id]
        if live.first_token_time is None:
            live.first_token_time = now
            self._event(now, "first_token", seq.request.request_id, seq.seq_id)

    def token(self, seq: Sequence, now: float) -> None:
        """An output token of sample 0 (the scheduler's hot path appends to `token_list` directly)."""
        self._live[seq.request.request_id].token_times.append(now)

    def token_list(self, request: Request) -> list[float]:
        """The live list of sample 0's output token times, for cheap appends in the hot path."""
        return self._live[request.request_id].token_times

    def live_progress(self, request_id: str) -> tuple[float | None, int]:
        """A live request's first scheduled time and preemption count so far."""
        live = self._live[request_id]
        return live.first_scheduled_time, live.num_preemptions

    def hand_over(self, request: Request, now: float) -> None:
        """A prefill replica's request moved to a decode replica (its transfer is done): it leaves
        this recorder without a row (the decode replica's recorder writes it)."""
        del self._live[request.request_id]
        self._event(now, "handed_off", request.request_id, None)

    def take_over(self, request: Request, first_scheduled_time: float | None, num_preemptions: int,
                  extra: dict, now: float) -> None:
        """A decode replica received a request whose first token reaches the user now: its row will
        carry the prefill side's queueing and preemptions, its first token time `now`, and `extra`."""
        self._live[request.request_id] = _Live(request, first_scheduled_time, now, num_preemptions,
                                               token_times=[now], extra=extra)
        self._event(now, "received", request.request_id, None)

    def preempted(self, seq: Sequence, mode: str, now: float) -> None:
        if mode not in PREEMPTION_EVENT_MODES:
            raise ValueError(f"mode={mode!r} is invalid: choose one of {PREEMPTION_EVENT_MODES}")
        self._live[seq.request.request_id].num_preemptions += 1
        self._event(now, "preempted", seq.request.request_id, seq.seq_id, mode)

    def swapped_out(self, seq: Sequence, now: float) -> None:
        self._live[seq.request.request_id].num_swaps += 1
        self._event(now, "swapped_out", seq.request.request_id, seq.seq_id)

    def swapped_in(self, seq: Sequence, now: float) -> None:
        self._live[seq.request.request_id].num_swaps += 1
        self._event(now, "swapped_in", seq.request.request_id, seq.seq_id)

    def finished(self, request: Request, seqs: Iterable[Sequence], now: float) -> dict:
        return self._close("finished", request, seqs, now)

    def aborted(self, request: Request, seqs: Iterable[Sequence], now: float) -> dict:
        return self._close("aborted", request, seqs, now)

    def step(self, row: dict) -> None:
        (self._pending if self._pending else self._steps).append(row)

    def decode_run(self, run: DecodeRunSteps) -> None:
        """The rows of a fast-forwarded decode run's steps."""
        self._pending.append(run)

    def _close(self, status: str, request: Request, seqs: Iterable[Sequence], now: float) -> dict:
        live = self._live.pop(request.request_id)
        self._event(now, status, request.request_id, None, request.finish_reason or "")
        seqs = list(seqs)
        seq0_outputs = next((s.num_output_tokens for s in seqs if s.sample_index == 0), 0)
        row = request_row(
            request.request_id, request.arrival_time, request.priority, request.num_prompt_tokens,
            sum(s.num_output_tokens for s in seqs), request.sampling_params.n, live.first_scheduled_time,
            live.first_token_time, now, status, request.finish_reason, live.token_times, seq0_outputs,
            live.num_preemptions, live.num_swaps, request.tenant)
        if live.extra:
            row.update(live.extra)
        self.requests.append(row)
        return row

    @property
    def num_live(self) -> int:
        """Requests that arrived and have not ended yet."""
        return len(self._live)


_row_values = itemgetter(*STEP_COLUMNS)


def _add_rows(columns: dict[str, list], rows: list[dict]) -> None:
    """Append step rows to `columns` (one transposition, not a loop per value)."""
    if rows:
        for values, transposed in zip(columns.values(), zip(*map(_row_values, rows))):
            values.extend(transposed)
