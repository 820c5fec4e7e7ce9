"""From the scheduler's progress to `RequestOutput`s: each live request's output state, its text
(incremental detokenization, stop strings), its logprobs, and vLLM's three output kinds.

`SamplingParams.output_kind` picks what `LLMEngine.step()` returns for a request:
- "cumulative": every step the request makes progress, its whole text and token ids so far;
- "delta": only what is new since its last output (each sample that changed);
- "final_only": one output, when it ends (`LLM.generate` uses it: no per-step work at all).
A request's last output has `finished=True` in every kind. Text follows vLLM's rules: a stop string
and the text after it are cut (kept with `include_stop_str_in_output`), the text of the stop token
that ended a sample (EOS or one of `stop_token_ids`) is dropped (kept with the same flag), and
while a request with stop strings is unfinished the last `max(len(stop)) - 1` characters are held
back, so a stop string is never streamed before it is recognised.

One request's data never stops the others: an exception while handling one request (its text, stop
strings, logprobs, its output) is logged with its traceback and recorded in `failed`; the engine
aborts that request (finish_reason "abort:error"), its final output carries the short error, and
every other request goes on.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.offline.detokenizer import DecodeState, Detokenizer, find_stop_string
from engine.offline.outputs import CompletionOutput, RequestMetrics, RequestOutput, short_error
from policies.lookahead import PENDING
from policies.outputs import SchedulerOutput
from policies.request import Request
from policies.sequence import Sequence, SequenceStatus

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class LiveRequest:
    """A request the engine has not handed its final output for yet."""

    request: Request
    prompt: str | None
    seqs: list[Sequence]  # the scheduler's list of the request's sequences (grows on fork)
    streams: bool  # output_kind is not "final_only"
    stop_ids: frozenset[int]  # tokens that end a sample: EOS (unless ignore_eos) and stop_token_ids
    hold_back: int = 0  # characters kept back while unfinished (stop strings)
    # seq_id -> incremental text (stop strings or streaming); (parent seq_id, i) for a just-forked
    # sample i until the update makes its sequence
    text_states: dict[int | tuple[int, int], DecodeState] | None = None
    logprobs: dict[int, list[dict[int, float]]] | None = None  # seq_id -> per-token logprobs
    # "delta" only: seq_id -> [tokens, characters, logprobs, finished] already handed out
    sent: dict[int, list[int]] | None = None


@dataclass(slots=True)
class OutputProcessor:
    detokenizer: Detokenizer | None
    detokenize: bool = True  # EngineArgs.detokenize: False leaves every text empty
    live: dict[str, LiveRequest] = field(default_factory=dict)
    text: dict[str, LiveRequest] = field(default_factory=dict)  # live requests with text states
    num_streaming: int = 0
    num_logprobs: int = 0
    forking: list[LiveRequest] = field(default_factory=list)  # forked first tokens' states to move
    failed: dict[str, str] = field(default_factory=dict)  # request id -> short error, until it ends
    to_abort: list[str] = field(default_factory=list)  # failed since the engine last took them

    def add(self, request: Request, prompt: str | None, seqs: list[Sequence]) -> None:
        params = request.sampling_params
        stop_ids = set(params.stop_token_ids)
        if request.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(request.eos_token_id)
        live = LiveRequest(request, prompt, seqs, params.streams, frozenset(stop_ids))
        if params.stop or (live.streams and self.detokenizer is not None and self.detokenize):
            live.text_states = {}
            self.text[request.request_id] = live
            if params.stop and not params.include_stop_str_in_output:
                live.hold_back = max(map(len, params.stop)) - 1
        if params.output_kind == "delta":
            live.sent = {}
        if params.logprobs is not None:
            live.logprobs = {}
            self.num_logprobs += 1
        self.num_streaming += live.streams
        self.live[request.request_id] = live

    def take_over(self, request: Request, prompt: str | None, seqs: list[Sequence]) -> RequestOutput | None:
        """`add` a request whose sequences already hold output tokens (sampled by another engine: a
        disaggregated pair's prefill engine), their text decoded as far as it goes; its output now if
        it streams."""
        self.add(request, prompt, seqs)
        live = self.live[request.request_id]
        if live.text_states is not None:
            params = request.sampling_params
            for seq in seqs:
                state = live.text_states[seq.seq_id] = self.detokenizer.new_state(seq.num_prompt_tokens,
                                                                                   params.skip_special_tokens)
                if not seq.is_finished:
                    self.detokenizer.update(state, seq.token_ids)
        if not live.streams:
            return None
        return self.output(live, RequestMetrics(request.arrival_time), finished=False)

    def drop(self, request_id: str) -> LiveRequest:
        """Forget a live request without an output (it moved to another engine: a prefill engine's
        hand-off, engine/disagg/)."""
        live = self.live.pop(request_id)
        self.text.pop(request_id, None)
        self.num_streaming -= live.streams
        self.num_logprobs -= live.logprobs is not None
        self.failed.pop(request_id, None)
        return live

    # ---- before the scheduler's update: text and stop strings ----------------------------------
    def advance_text(self, tokens: dict[int, list[int]]) -> list[int | tuple[int, int]]:
        """Detokenize the step's new tokens of the requests with text states; returns the seq ids whose
        text now holds a stop string (checked once min_tokens are out, as vLLM). A prompt that samples
        n tokens: token i > 0 starts the child forked in this step's update, checked on its own state
        and named `(seq_id, i)`; `adopt_forks` hands that state to the child afterwards. A token that
        will end its sample (a stop token) adds no text unless include_stop_str_in_output."""
        stopped, failed = [], self.failed
        for live in self.text.values():
            if failed and live.request.request_id in failed:
                continue
            try:
                self._advance_text(live, tokens, stopped)
            except Exception as exc:  # noqa: BLE001 (one request's failure: it alone is aborted)
                self._fail(live, exc)
        return stopped

    def _advance_text(self, live: LiveRequest, tokens: dict[int, list[int]],
                      stopped: list[int | tuple[int, int]]) -> None:
        detok, states = self.detokenizer, live.text_states
        params = live.request.sampling_params
        keep_stop = params.include_stop_str_in_output
        for seq in live.seqs:
            new = tokens.get(seq.seq_id)
            if new is None:
                continue
            # Looked past (async scheduling): the token is already in place, as PENDING. A length
            # rule may have ended the sequence then; its last token can still complete a stop
            # string, which wins (the scheduler turns "length" into "stop").
            ids, num_out = seq.token_ids, seq.num_output_tokens
            pending = ids[-1] == PENDING
            if seq.is_finished and not (pending and seq.status is SequenceStatus.FINISHED_LENGTH):
                continue
            num_ids = len(ids) - pending
            num_out -= len(ids) - num_ids
            may_stop = num_out + 1 >= params.min_tokens
            for i, token in enumerate(new):
                key = seq.seq_id if i == 0 else (seq.seq_id, i)
                state = states.get(key)
                if state is None:
                    state = states[key] = detok.new_state(seq.num_prompt_tokens, params.skip_special_tokens)
                    if i == 1:  # once per forking prompt
                        self.forking.append(live)
                if state.stopped is not None or (may_stop and token in live.stop_ids and not keep_stop):
                    continue
                added = detok.update(state, ids, [token], num_ids=num_ids)
                if may_stop and params.stop and find_stop_string(state, added, params.stop, keep_stop):
                    stopped.append(key)

    def _fail(self, live: LiveRequest, exc: Exception) -> None:
        """Record a request whose handling raised (the engine aborts it) and log its traceback."""
        request_id = live.request.request_id
        if request_id not in self.failed:
            _log.error("request %s failed in the engine and is aborted (the others go on)", request_id,
                       exc_info=exc)
            self.failed[request_id] = short_error(exc)
            self.to_abort.append(request_id)

    # ---- after the update ----------------------------------------------------------------------
    def adopt_forks(self) -> None:
        """Move the text states of forked first tokens, keyed (parent seq id, i), to the children the
        update made (sample i of the family)."""
        for live in self.forking:
            by_index = {seq.sample_index: seq.seq_id for seq in live.seqs}
            states = live.text_states
            for key in [k for k in states if isinstance(k, tuple)]:
                state = states.pop(key)
                child = by_index.get(key[1])
                if child is not None:
                    states[child] = state
        self.forking.clear()

    def collect_logprobs(self, out: SchedulerOutput, results: dict) -> None:
        for entry in out.scheduled:
            if not entry.num_samples:
                continue
            live = self.live.get(entry.seq.request.request_id)
            result = results.get(entry.seq.seq_id)
            if live is None or live.logprobs is None or result is None or result.logprobs is None:
                continue
            # A prompt that sampled n tokens: token i went to sample i (the scheduler's fork order).
            try:
                for seq, lp in zip(live.seqs if entry.num_samples > 1 else [entry.seq], result.logprobs):
                    live.logprobs.setdefault(seq.seq_id, []).append(lp)
            except Exception as exc:  # noqa: BLE001 (one request's failure: it alone is aborted)
                self._fail(live, exc)

    def progress(self, out: SchedulerOutput, tokens: dict[int, list[int]]) -> list[RequestOutput]:
        """Outputs of the streaming requests (not ended) that got tokens in the step."""
        seen, outputs = set(), []
        live_requests = self.live
        for entry in out.scheduled:
            if not entry.num_samples or entry.seq.seq_id not in tokens:
                continue
            request_id = entry.seq.request.request_id
            live = live_requests.get(request_id)
            if live is None or not live.streams or request_id in seen or request_id in self.failed:
                continue
            seen.add(request_id)
            try:
                output = self.output(live, RequestMetrics(live.request.arrival_time), finished=False)
            except Exception as exc:  # noqa: BLE001 (one request's failure: it alone is aborted)
                self._fail(live, exc)
                continue
            if output is not None:
                outputs.append(output)
        return outputs

    def finish(self, request: Request, row: dict) -> RequestOutput:
        """The final output of an ended request (`row`: its trace row), which leaves the live set."""
        if row["request_id"] != request.request_id:
            raise RuntimeError(f"trace row {row['request_id']!r} does not match ended request "
                               f"{request.request_id!r}: the recorder and the scheduler disagree")
        live = self.live.pop(request.request_id)
        self.text.pop(request.request_id, None)
        self.num_streaming -= live.streams
        self.num_logprobs -= live.logprobs is not None
        metrics = RequestMetrics(arrival_time=row["arrival_time"],
                                 first_scheduled_time=row["first_scheduled_time"],
                                 first_token_time=row["first_token_time"], finished_time=row["finish_time"],
                                 num_preemptions=row["num_preemptions"])
        try:
            output = self.output(live, metrics, finished=True)
        except Exception as exc:  # noqa: BLE001 (one request's failure: it alone ends with an error)
            self._fail(live, exc)
            output = RequestOutput(request.request_id, live.prompt, request.prompt_token_ids,
                                   [CompletionOutput(seq.sample_index, "", [], seq.finish_reason or "abort:error")
                                    for seq in live.seqs], finished=True, metrics=metrics)
        output.error = self.failed.pop(request.request_id, None)
        return output

    # ---- one output ----------------------------------------------------------------------------
    def output(self, live: LiveRequest, metrics: RequestMetrics, finished: bool) -> RequestOutput | None:
        """The request's output now, in its kind; None for a delta with nothing new."""
        completions = []
        for seq in live.seqs:
            completion = self._completion(live, seq)
            if completion is not None:
                completions.append(completion)
        if not completions and not finished:
            return None
        request = live.request
        return RequestOutput(request.request_id, live.prompt, request.prompt_token_ids, completions,
                             finished=finished, metrics=metrics,
                             num_cached_tokens=live.seqs[0].num_cached_tokens or 0)

    def _completion(self, live: LiveRequest, seq: Sequence) -> CompletionOutput | None:
        np_, ids = seq.num_prompt_tokens, seq.token_ids
        num_ids = len(ids) - (ids[-1] == PENDING)
        reason = seq.finish_reason
        text, stop_reason = self._text(live, seq, num_ids)
        if reason == "stop" and stop_reason is None and num_ids > np_ \
                and ids[num_ids - 1] in live.request.sampling_params.stop_token_ids:
            stop_reason = ids[num_ids - 1]
        logprobs = live.logprobs.get(seq.seq_id, []) if live.logprobs is not None else None
        sent = live.sent
        if sent is None:
            return CompletionOutput(seq.sample_index, text, ids[np_:num_ids], reason, stop_reason,
                                    None if logprobs is None else list(logprobs))
        mark = sent.get(seq.seq_id)
        if mark is None:
            mark = sent[seq.seq_id] = [np_, 0, 0, 0]
        num_tokens, num_chars, num_lp, was_finished = mark
        if was_finished or (num_ids == num_tokens and len(text) == num_chars and reason is None):
            return None
        sent[seq.seq_id] = [num_ids, len(text), 0 if logprobs is None else len(logprobs), reason is not None]
        return CompletionOutput(seq.sample_index, text[num_chars:], ids[num_tokens:num_ids], reason, stop_reason,
                                None if logprobs is None else logprobs[num_lp:])

    def _text(self, live: LiveRequest, seq: Sequence, num_ids: int) -> tuple[str, str | None]:
        """(text so far, stop string that ended it). Unfinished: what is safe to show; finished: all of
        it, the ending stop token's text dropped unless include_stop_str_in_output."""
        detok = self.detokenizer
        states = live.text_states
        params = live.request.sampling_params
        finished = seq.finish_reason is not None
        drop = (finished and seq.finish_reason == "stop" and not params.include_stop_str_in_output
                and num_ids > seq.num_prompt_tokens and seq.token_ids[num_ids - 1] in live.stop_ids)
        if states is None:
            if not finished or detok is None or not self.detokenize:
                return "", None
            return detok.decode_output(seq.token_ids, seq.num_prompt_tokens, params.skip_special_tokens,
                                       num_ids - drop), None
        state = states.get(seq.seq_id)
        if state is None:
            state = states[seq.seq_id] = detok.new_state(seq.num_prompt_tokens, params.skip_special_tokens)
        if not finished:
            text = state.text
            return text[:len(text) - live.hold_back] if live.hold_back else text, None
        if state.stopped is None and not state.flushed:
            # Tokens not checked yet (a length rule ended the sample ahead, or it forked in its last
            # step), and an incomplete last character, come out now.
            added = detok.update(state, seq.token_ids, final=True, num_ids=num_ids - drop)
            if params.stop and seq.num_output_tokens >= params.min_tokens:
                find_stop_string(state, added, params.stop, params.include_stop_str_in_output)
        state.flushed = True
        return state.text, state.stopped
