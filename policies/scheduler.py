"""The Scheduler: continuous batching over waiting / running / swapped queues (vLLM v0 semantics).

Each step, `schedule(now)`:
  0. (policies that allow it, e.g. priority) lets the waiting head force out running sequences it
     may preempt until it fits;
  1. schedules running sequences in policy order: decodes first (1 token each, preempting the
     policy's victim among not-yet-scheduled running sequences when KV runs out), then the next
     chunk of running prefills from the remaining token budget;
  2. if step 1 preempted nothing, serves the swapped and waiting queues merged in policy order
     (swap in / admit) while the budgets and the block manager allow; the first that must wait
     stops the walk (head-of-line, so no request overtakes an earlier one), one that can never fit
     is aborted as `too_long`.
Without chunked prefill (vLLM v0 default): a step that can admit waiting prompts (whole, within
the token budget) is prefill-only; otherwise it runs step 1 and then swaps in.
`update(out, tokens, now)` advances progress, appends tokens, forks parallel samples, applies the
stop rules, frees finished sequences and records the step. See preemption.py and queues.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from policies.blocks.base import AllocStatus, BlockManager
from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.policy.base import Policy
from policies.preemption import Preemptor
from policies.queues import SchedulerQueues, seq_cost
from policies.request import Request
from policies.sequence import Sequence, SequenceStatus
from policies.trace import TraceRecorder

RUNNING, WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING
FINISHED = SequenceStatus.FINISHED_STOPPED  # statuses >= this are finished
LATER, NEVER = AllocStatus.LATER, AllocStatus.NEVER


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill={self.enable_chunked_prefill!r} is invalid: "
                             "must be True or False")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is invalid: without "
                             f"chunked prefill a whole prompt must fit in one step, so it must be >= "
                             f"max_model_len={self.max_model_len}")


@dataclass(slots=True)
class _StepStats:
    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    num_partial: int = 0  # prefill chunks that do not finish their sequence (sample nothing)
    num_running: int = 0  # running sequences when schedule() returned


class Scheduler:
    def __init__(self, config: SchedulerConfig, policy: Policy, block_manager: BlockManager,
                 recorder: TraceRecorder | None = None) -> None:
        self.config = config
        self.policy = policy
        self.block_manager = block_manager
        self.recorder = TraceRecorder() if recorder is None else recorder
        self.queues = SchedulerQueues(policy.key)
        self.preemptor = Preemptor(self.queues, block_manager, policy, self.recorder)
        self._may_force = type(policy).may_preempt is not Policy.may_preempt
        overridden = type(block_manager).mark_computed is not BlockManager.mark_computed
        self._mark_computed = block_manager.mark_computed if overridden else None
        self._seqs: dict[str, list[Sequence]] = {}  # live request id -> its sequences (sample order)
        self._seen: set[str] = set()
        # Per live sequence: (stop length, min length, eos or None, stop ids or None, token times).
        self._stop_info: dict[Sequence, tuple] = {}
        self._decode_entries: dict[Sequence, ScheduledSeq] = {}  # reused every decode step
        # Decode fast path: every running sequence has exactly one token to compute, and the
        # entries of the last full decode batch (valid while the running queue is unchanged).
        self._all_decoding = False
        self._batch_entries: tuple[int, list[ScheduledSeq]] = (-1, [])
        self._block_mask = block_manager.block_size - 1
        self._next_seq_id = 0
        self._num_added = 0
        self._now = 0.0
        self._step = 0
        self._stats = _StepStats()
        self._stats_out: SchedulerOutput | None = None
        self._ended: list[Request] = []  # returned by the next update()
        self._to_report: list[Request] = []  # aborted requests for the next out.aborted
        self._aborted_in_flight = False  # a running sequence was aborted after schedule()

    # ---- queries --------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.queues.waiting)

    @property
    def num_running(self) -> int:
        return len(self.queues.running)

    @property
    def num_swapped(self) -> int:
        return len(self.queues.swapped)

    def has_unfinished(self) -> bool:
        return self.queues.has_unfinished()

    def sequences(self, request_id: str) -> list[Sequence]:
        """A live request's sequences in sample order. The list itself (children are appended as
        samples fork) stays valid after the request ends, so the engine can build its outputs."""
        return self._seqs[request_id]

    def check_invariants(self) -> None:
        """For tests, between steps: queues ordered and consistent, every live sequence queued or
        finished, sequence slots within max_num_seqs, and the block manager's own invariants."""
        self.queues.check()
        live = [seq for family in self._seqs.values() for seq in family]
        queued = {id(seq) for queue in (self.queues.waiting, self.queues.running, self.queues.swapped)
                  for seq in queue}
        assert all(seq.is_finished or id(seq) in queued for seq in live), "a live sequence is lost"
        assert len(queued) == sum(not seq.is_finished for seq in live), "a queued sequence is not live"
        assert self.queues.running_cost <= self.config.max_num_seqs, "running sequences exceed max_num_seqs"
        self.block_manager.check_invariants(live)

    # ---- requests -------------------------------------------------------------------------
    def add(self, request: Request, now: float) -> None:
        request.validate(self.config.max_model_len)
        n = request.sampling_params.n
        if n > self.config.max_num_seqs:
            raise ValueError(f"n={n} is invalid: a request's samples must fit in one batch, "
                             f"n <= max_num_seqs={self.config.max_num_seqs}")
        if request.request_id in self._seen:
            raise ValueError(f"request_id={request.request_id!r} is invalid: already added to this scheduler")
        self._seen.add(request.request_id)
        seq = Sequence.from_request(self._new_seq_id(), request)
        seq.arrival_index = self._num_added
        self._num_added += 1
        self._seqs[request.request_id] = [seq]
        self.recorder.arrived(request, now)
        self._register(seq)
        self.queues.add_waiting(seq)

    def abort(self, request_id: str, reason: str = "user", now: float | None = None) -> bool:
        seqs = self._seqs.get(request_id) if isinstance(request_id, str) else None
        if seqs is None:
            return False
        self._abort_request(seqs[0].request, str(reason), self._now if now is None else now)
        return True

    # ---- schedule -------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self._now = now
        out = SchedulerOutput(now)
        self._stats, self._stats_out = _StepStats(), out
        self.preemptor.begin_step()
        queues, budget = self.queues, self.config.max_num_batched_tokens
        if self._may_force and queues.waiting and queues.running:
            self._force_preempt(out, now)
        if self.config.enable_chunked_prefill:
            budget, preempted = self._schedule_running(out, budget, now)
            if not preempted:
                self._admit(out, budget, now, take_waiting=True, take_swapped=True)
        elif not self._admit(out, budget, now, take_waiting=True, take_swapped=False)[1]:
            budget, preempted = self._schedule_running(out, budget, now)
            if not preempted:
                self._admit(out, budget, now, take_waiting=False, take_swapped=True)
        self.preemptor.end_step()
        self._stats.num_running = len(queues.running)
        if self._to_report:  # aborted since the last schedule(), including too_long ones just now
            out.aborted, self._to_report = self._to_report, []
        return out

    def _force_preempt(self, out: SchedulerOutput, now: float) -> None:
        """Let the waiting head push out running sequences the policy allows, until it fits."""
        queues, head = self.queues, self.queues.waiting[0]
        if queues.swapped and queues.key(queues.swapped[0]) < queues.key(head):
            return  # the swapped head is served first anyway
        cost, may_preempt = seq_cost(head), self.policy.may_preempt
        while queues.running:
            if (queues.running_cost + cost <= self.config.max_num_seqs
                    and self.block_manager.can_allocate(head) is not LATER):
                return
            allowed = [seq for seq in queues.running if may_preempt(head, seq)]
            if not allowed:
                return
            self.preemptor.preempt(self.preemptor.pick_victim(allowed), out, now)

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float) -> tuple[int, bool]:
        running = self.queues.running
        if not running:
            return budget, False
        if self._all_decoding:
            decodes, prefills = running, []
        else:
            decodes = [seq for seq in running if len(seq.token_ids) - seq.num_computed_tokens == 1]
            prefills = [seq for seq in running if len(seq.token_ids) - seq.num_computed_tokens != 1] \
                if len(decodes) < len(running) else []
        if len(decodes) > budget:
            decodes = decodes[:budget]
        # Hot path: one block-manager call for the whole decode batch when it surely fits.
        copies = self.block_manager.append_decode_slots(decodes) if decodes else []
        preempted = False
        if copies is not None:
            out.copy.extend(copies)
            version = self.queues.running_version
            if decodes is running and self._batch_entries[0] == version:
                out.scheduled.extend(self._batch_entries[1])
            else:
                out.scheduled.extend(map(self._decode_entries.__getitem__, decodes))
                if decodes is running:
                    self._batch_entries = (version, out.scheduled.copy())
            budget -= len(decodes)
        else:
            budget, preempted = self._schedule_one_by_one(out, list(decodes), budget, now, decode=True)
        self._stats.num_decode_seqs = len(out.scheduled)
        if prefills and budget:
            budget, preempted_prefill = self._schedule_one_by_one(out, prefills, budget, now, decode=False)
            preempted = preempted or preempted_prefill
        return budget, preempted

    def _schedule_one_by_one(self, out: SchedulerOutput, seqs: list[Sequence], budget: int, now: float,
                             decode: bool) -> tuple[int, bool]:
        """Reserve slots sequence by sequence, preempting victims when KV runs out."""
        block_manager, preempted = self.block_manager, False
        for seq in seqs:
            if not budget:
                break
            if seq.status is not RUNNING:
                continue  # a victim of this step
            chunk = len(seq.token_ids) - seq.num_computed_tokens
            if chunk > budget:
                if not self.config.enable_chunked_prefill:
                    continue
                chunk = budget
            if not block_manager.can_append_slots(seq, chunk):
                preempted = True
                if not self._make_room(seq, chunk, out, now):
                    continue
            out.copy.extend(block_manager.append_slots(seq, chunk))
            if decode:
                out.scheduled.append(self._decode_entries[seq])
            else:
                self._push_chunk(out, seq, chunk)
            budget -= chunk
        return budget, preempted

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput, now: float) -> bool:
        """Preempt victims among running sequences not scheduled this step until seq's slots fit;
        False if seq itself was the victim."""
        scheduled = {entry.seq for entry in out.scheduled}
        while True:
            candidates = [s for s in self.queues.running if s not in scheduled]
            victim = self.preemptor.pick_victim(candidates)
            self.preemptor.preempt(victim, out, now)
            if victim is seq:
                return False
            if self.block_manager.can_append_slots(seq, num_tokens):
                return True

    def _admit(self, out: SchedulerOutput, budget: int, now: float, take_waiting: bool,
               take_swapped: bool) -> tuple[int, bool]:
        """Swap in / admit from the swapped and waiting queues merged in policy order.
        Returns the remaining budget and whether anything was scheduled."""
        queues, block_manager, config = self.queues, self.block_manager, self.config
        key, victims = queues.key, self.preemptor.victims
        num_scheduled = len(out.scheduled)
        while budget > 0:
            waiting = queues.waiting[0] if take_waiting and queues.waiting else None
            swapped = queues.swapped[0] if queues.swapped else None
            from_swap = swapped is not None and (waiting is None or key(swapped) < key(waiting))
            if from_swap and not take_swapped:
                break
            seq = swapped if from_swap else waiting
            if seq is None or (victims and seq in victims):
                break
            cost = seq_cost(seq)
            need = len(seq.token_ids) - seq.num_computed_tokens
            if queues.running_cost + cost > config.max_num_seqs or (
                    need > budget and not config.enable_chunked_prefill):
                break
            status = block_manager.can_swap_in(seq) if from_swap else block_manager.can_allocate(seq)
            if status is LATER and not queues.running:
                status = NEVER  # the GPU pool holds no running sequence: waiting cannot help
            if status is NEVER:
                self._abort_request(seq.request, "too_long", now, out)
                continue
            if status is LATER:
                break
            if from_swap:
                queues.swapped.popleft()
                out.swap_in.update(block_manager.swap_in(seq))
                queues.add_running(seq)
                self.recorder.swapped_in(seq, now)
            else:
                queues.waiting.popleft()
                block_manager.allocate(seq)  # may skip prefix-cached tokens
                queues.add_running(seq)
                self.recorder.scheduled(seq, now)
            chunk = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            # A swapped-in block table may lack the slot of the token to compute next.
            if not block_manager.can_append_slots(seq, chunk):
                continue  # stays running; the next step's decode pass handles it
            out.copy.extend(block_manager.append_slots(seq, chunk))
            self._push_chunk(out, seq, chunk)
            budget -= chunk
        return budget, len(out.scheduled) > num_scheduled

    def _push_chunk(self, out: SchedulerOutput, seq: Sequence, chunk: int) -> None:
        uncomputed = len(seq.token_ids) - seq.num_computed_tokens
        # A chunk that completes the sequence samples: n tokens for an unforked parallel prompt.
        samples = seq_cost(seq) if chunk == uncomputed else 0
        out.scheduled.append(ScheduledSeq(seq, chunk, samples))
        stats = self._stats
        stats.num_partial += not samples
        if uncomputed > 1:
            stats.num_prefill_tokens += chunk
            stats.num_prefill_seqs += 1
        else:
            stats.num_decode_seqs += 1

    # ---- update ---------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, new_token_ids: dict[int, list[int]], now: float,
               stop_seq_ids: Collection[int] = ()) -> list[Request]:
        if self._stats_out is not out:
            raise ValueError("update() got an output that is not the last one schedule() returned")
        self._now = now
        mark, skip_aborted = self._mark_computed, self._aborted_in_flight
        # mark_computed is due after a prefill chunk, after a decode that fills a block, and after
        # any step that ran block copies (contiguous releases their sources then).
        mask = 0 if out.copy else self._block_mask
        stop_info, first_token = self._stop_info, self.recorder.first_token
        finish, fork = self._finish, self._fork
        stats = self._stats
        self.queues.kv_tokens += stats.num_prefill_tokens + stats.num_decode_seqs
        # The hot loop: one decode token per sequence, stop rules inlined (see _append_token).
        for seq, num_new, num_samples in out.scheduled:
            if skip_aborted and seq.status is not RUNNING:
                self.queues.kv_tokens -= num_new  # aborted between schedule() and update()
                continue
            seq.num_computed_tokens += num_new
            if mark is not None and (num_new != 1 or not seq.num_computed_tokens & mask):
                mark(seq)
            if num_samples != 1:
                if num_samples:
                    fork(seq, self._tokens_for(seq, num_samples, new_token_ids), now, stop_seq_ids)
                continue
            try:
                (token,) = new_token_ids[seq.seq_id]
            except (KeyError, TypeError, ValueError):
                self._tokens_for(seq, 1, new_token_ids)  # raises a clear ValueError
                raise
            token_ids = seq.token_ids
            token_ids.append(token)
            stop_len, min_len, eos, stop_ids, times = stop_info[seq]
            if times is not None:
                if not times:
                    first_token(seq, now)
                times.append(now)
            num_tokens = len(token_ids)
            if num_tokens >= min_len and (token == eos or (stop_ids is not None and token in stop_ids)
                                          or (stop_seq_ids and seq.seq_id in stop_seq_ids)):
                finish(seq, SequenceStatus.FINISHED_STOPPED, "stop", now)
            elif num_tokens >= stop_len:
                finish(seq, SequenceStatus.FINISHED_LENGTH, "length", now)
        # Every running sequence sampled this step: each now has exactly one token to compute.
        self._all_decoding = (not skip_aborted and
                              len(out.scheduled) - stats.num_partial == stats.num_running)
        self._aborted_in_flight = False
        ended, self._ended = self._ended, []
        self._record_step(out, now, ended)
        return ended

    @staticmethod
    def _tokens_for(seq: Sequence, num_samples: int, new_token_ids: dict[int, list[int]]) -> list[int]:
        tokens = new_token_ids.get(seq.seq_id) if isinstance(new_token_ids, dict) else None
        if not isinstance(tokens, (list, tuple)) or len(tokens) != num_samples:
            raise ValueError(f"new_token_ids[{seq.seq_id}]={tokens!r} is invalid: sequence {seq.seq_id} "
                             f"was scheduled to sample {num_samples} token(s)")
        return list(tokens)

    def _append_token(self, seq: Sequence, token: int, now: float, stop_seq_ids: Collection[int]) -> None:
        token_ids = seq.token_ids
        token_ids.append(token)
        stop_len, min_len, eos, stop_ids, times = self._stop_info[seq]
        if times is not None:
            if not times:
                self.recorder.first_token(seq, now)
            times.append(now)
        num_tokens = len(token_ids)
        # vLLM's order: stop conditions (after min_tokens) win over length limits.
        if num_tokens >= min_len and (token == eos or (stop_ids is not None and token in stop_ids)
                                      or (stop_seq_ids and seq.seq_id in stop_seq_ids)):
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, "stop", now)
        elif num_tokens >= stop_len:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, "length", now)

    def _fork(self, parent: Sequence, tokens: list[int], now: float, stop_seq_ids: Collection[int]) -> None:
        """The prompt of a parallel-sampling request is done: children share its blocks (CoW)."""
        family = self._seqs[parent.request.request_id]
        children = []
        for sample_index in range(1, len(tokens)):
            child = parent.fork(self._new_seq_id(), sample_index)
            self.block_manager.fork(parent, child)
            family.append(child)
            self._register(child)
            self.queues.add_running(child, cost=0)  # the parent held n slots since admission
            children.append(child)
        self._decode_entries[parent] = ScheduledSeq(parent, 1, 1)
        for seq, token in zip([parent, *children], tokens):
            self._append_token(seq, token, now, stop_seq_ids)

    # ---- endings --------------------------------------------------------------------------
    def _finish(self, seq: Sequence, status: SequenceStatus, reason: str, now: float) -> None:
        self.queues.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = status, reason
        family = self._seqs[seq.request.request_id]
        if all(s.status >= FINISHED for s in family):
            seq.request.finish_reason = family[0].finish_reason  # sample 0 speaks for the request
            self._end_request(seq.request, family, now, aborted=False)

    def _abort_request(self, request: Request, reason: str, now: float,
                       out: SchedulerOutput | None = None) -> None:
        family = self._seqs[request.request_id]
        for seq in family:
            status = seq.status
            if status >= FINISHED:
                continue
            if not (status is WAITING and self.preemptor.discard(seq)):
                self.queues.remove(seq)
            if status is RUNNING or status is SequenceStatus.SWAPPED:
                self.block_manager.free(seq)
                self._aborted_in_flight = True
            seq.status, seq.finish_reason = SequenceStatus.FINISHED_ABORTED, f"abort:{reason}"
        request.finish_reason = f"abort:{reason}"
        if out is not None and any(entry.seq.request is request for entry in out.scheduled):
            out.scheduled[:] = [entry for entry in out.scheduled if entry.seq.request is not request]
            self._recount(out)
        self._end_request(request, family, now, aborted=True)

    def _end_request(self, request: Request, family: list[Sequence], now: float, aborted: bool) -> None:
        del self._seqs[request.request_id]
        for seq in family:
            self._stop_info.pop(seq, None)
            self._decode_entries.pop(seq, None)
        if aborted:
            self.recorder.aborted(request, family, now)
            self._to_report.append(request)
        else:
            self.recorder.finished(request, family, now)
        self._ended.append(request)

    # ---- bookkeeping ----------------------------------------------------------------------
    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _register(self, seq: Sequence) -> None:
        request, params = seq.request, seq.request.sampling_params
        stop_len = min(seq.num_prompt_tokens + params.max_tokens, self.config.max_model_len)
        eos = None if params.ignore_eos else request.eos_token_id
        times = self.recorder.token_list(request) if seq.sample_index == 0 else None
        self._stop_info[seq] = (stop_len, seq.num_prompt_tokens + params.min_tokens, eos,
                                frozenset(params.stop_token_ids) or None, times)
        self._decode_entries[seq] = ScheduledSeq(seq, 1, seq_cost(seq))

    def _recount(self, out: SchedulerOutput) -> None:
        self._stats = stats = _StepStats()
        self._stats_out = out
        for seq, num_new, num_samples in out.scheduled:
            stats.num_partial += not num_samples
            if len(seq.token_ids) - seq.num_computed_tokens > 1:
                stats.num_prefill_tokens += num_new
                stats.num_prefill_seqs += 1
            else:
                stats.num_decode_seqs += 1

    def _record_step(self, out: SchedulerOutput, now: float, ended: list[Request]) -> None:
        stats, counts = self._stats, self.preemptor.counts
        usage, queues = self.block_manager.usage(), self.queues
        num_aborted = sum(1 for r in ended if r.finish_reason.startswith("abort:"))
        self.recorder.step({
            "step": self._step, "time": out.now, "duration": now - out.now,
            "num_batched_tokens": stats.num_prefill_tokens + stats.num_decode_seqs,
            "num_prefill_tokens": stats.num_prefill_tokens, "num_prefill_seqs": stats.num_prefill_seqs,
            "num_decode_seqs": stats.num_decode_seqs, "num_running": len(queues.running),
            "num_waiting": len(queues.waiting), "num_swapped": len(queues.swapped),
            "gpu_blocks_used": usage.gpu_used, "gpu_blocks_total": usage.gpu_total,
            "cpu_blocks_used": usage.cpu_used, "cpu_blocks_total": usage.cpu_total,
            "kv_tokens": queues.kv_tokens, "num_swap_out_blocks": len(out.swap_out),
            "num_swap_in_blocks": len(out.swap_in), "num_copy_blocks": len(out.copy),
            "num_preempted_recompute": counts.recompute, "num_preempted_swap": counts.swap,
            "num_swap_fallbacks": counts.swap_fallbacks, "num_finished": len(ended) - num_aborted,
            "num_aborted": num_aborted, "prefix_hits": usage.prefix_hits,
            "prefix_queries": usage.prefix_queries,
        })
        self._step += 1
