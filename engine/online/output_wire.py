"""A step's outputs on their way from the engine core to the front end: what crosses the pipe.

Each step the core sends one output per request that made progress; with many streams open that
is hundreds per step, pickled by the core and unpickled and turned back into `RequestOutput`s by
the front end's event loop, the same loop that writes every stream's chunks. Most of them are
one new token of one running request whose other facts did not change since the core last sent
them, so `OutputPacker` (the core's side) sends those as `(request_id, token_ids, text)` and the
rest in full: a request's first output, its last, and any whose samples, logprobs, error,
cached-token count or metrics (preemptions) are new. `OutputReader` (the front end's side) keeps
what was sent in full per request until its last output, and builds the same `RequestOutput`
from either form (tests/serving/test_output_wire.py).

The prompt never comes back as the front end sent it: the reader is told each request's prompt
when it is handed over (`sent`) and puts it into the request's outputs. Only a text prompt's token
ids, which the core made (the front end never tokenized it), come with its first output. A
token-id prompt (every request of the HTTP server, which tokenizes text and chat itself) costs
the pipe nothing: 560 ids were ~15 us to pickle in the core and ~17 us to unpickle on the event
loop, on the way of every request's first token.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from engine.offline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.online.engine_stats import RequestStats

# In full: (request_id, finished, prompt token ids or None, samples, metrics, num_cached_tokens, error):
# the ids only in a text prompt's first output; a sample is (index, text, token_ids, finish_reason,
# stop_reason, logprobs). Compact: (request_id, token_ids, text), sample 0 of a request already known.
PackedOutput = tuple
COMPACT_LEN = 3


def _metrics(output: RequestOutput) -> tuple:
    m = output.metrics
    return m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time, m.num_preemptions


def pack(output: RequestOutput, first: bool, metrics: tuple | None = None) -> PackedOutput:
    """An output in full (`first`: the request's first, which carries a text prompt's token ids;
    `metrics`: its `_metrics`, if taken already)."""
    samples = [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in output.outputs]
    return (output.request_id, output.finished,
            output.prompt_token_ids if first and output.prompt is not None else None, samples,
            _metrics(output) if metrics is None else metrics, output.num_cached_tokens, output.error)


def unpack(packed: PackedOutput, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
    """An output sent in full, with its request's prompt."""
    request_id, finished, _, samples, metrics, num_cached, error = packed
    return RequestOutput(request_id, prompt, prompt_token_ids, [CompletionOutput(*s) for s in samples],
                         finished, RequestMetrics(*metrics), num_cached, error)


class OutputPacker:
    """The core's side: each output in the compact form where the front end can rebuild it."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple] = {}  # request id -> (metrics, num_cached_tokens) as last sent in full

    def is_first(self, output: RequestOutput) -> bool:
        """The request's first output (none of its outputs was packed yet)."""
        return output.request_id not in self._sent

    def pack(self, output: RequestOutput) -> PackedOutput:
        request_id = output.request_id
        known = self._sent.get(request_id)
        if output.finished:
            self._sent.pop(request_id, None)
            return pack(output, known is None)
        metrics = _metrics(output)
        state = (metrics, output.num_cached_tokens)
        if known == state and output.error is None and len(output.outputs) == 1:
            c = output.outputs[0]
            if c.index == 0 and c.finish_reason is None and c.logprobs is None:
                return request_id, c.token_ids, c.text
        self._sent[request_id] = state
        return pack(output, known is None, metrics)


class OutputReader:
    """The front end's side: `RequestOutput`s from either form, with the prompts it was told of."""

    def __init__(self) -> None:
        self._prompts: dict[str, str | list[int]] = {}  # request id -> its prompt, until its first output
        # request id -> (prompt, prompt token ids, metrics, num_cached_tokens) as last sent in full
        self._known: dict[str, tuple] = {}

    def sent(self, request_id: str, prompt: str | list[int]) -> None:
        """A request handed to the core, with its prompt as handed over (text or token ids)."""
        self._prompts[request_id] = prompt

    def refused(self, request_ids: Iterable[str]) -> None:
        """Requests the core refused: no output of theirs will come."""
        for request_id in request_ids:
            self._prompts.pop(request_id, None)

    def split_first(self, outputs: list[PackedOutput]) -> tuple[list[PackedOutput], list[PackedOutput]]:
        """The step's first outputs (of requests with none read yet) and the others, each in order."""
        known, first, rest = self._known, [], []
        for packed in outputs:
            (rest if len(packed) == COMPACT_LEN or packed[0] in known else first).append(packed)
        return first, rest

    def read(self, outputs: list[PackedOutput],
             finished: list[RequestStats]) -> Iterator[tuple[RequestOutput, RequestStats | None]]:
        """Each output of a step, with its request's RequestStats if it ended (`finished`)."""
        known = self._known
        records = {r.request_id: r for r in finished} if finished else {}
        for packed in outputs:
            request_id = packed[0]
            if len(packed) == COMPACT_LEN:
                prompt, prompt_ids, metrics, num_cached = known[request_id]
                sample = CompletionOutput(0, packed[2], packed[1], None, None, None)
                yield (RequestOutput(request_id, prompt, prompt_ids, [sample], False, RequestMetrics(*metrics),
                                     num_cached), None)
                continue
            finished_now = packed[1]
            entry = known.pop(request_id, None) if finished_now else known.get(request_id)
            if entry is not None:
                prompt, prompt_ids = entry[0], entry[1]
            else:  # the request's first output
                given = self._prompts.pop(request_id, None)
                if packed[2] is not None:  # a text prompt: its token ids, made by the core
                    prompt, prompt_ids = given, packed[2]
                else:  # token ids, as handed over ([] for a request this side was not told of)
                    prompt, prompt_ids = None, [] if given is None else given
            if not finished_now:
                known[request_id] = (prompt, prompt_ids, packed[4], packed[5])
            yield unpack(packed, prompt, prompt_ids), records.get(request_id)
