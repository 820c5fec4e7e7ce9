"""Sampling from the logits of the sampled rows, vectorised over the batch.

Per row: min_tokens (mask the stop ids and EOS while too few tokens were generated), penalties
(vLLM's: repetition over prompt and output tokens, then frequency and presence over output tokens;
greedy rows are penalized too), temperature (0 = greedy argmax), top_k, top_p, min_p, then one draw by the exponential-race trick
(argmax of probs / Exp(1) noise), which is an exact categorical sample. A row with `num_samples`
= n is expanded to n rows (parallel sampling from the prompt's last position). Rows of seeded
requests draw their noise from a per-sequence `torch.Generator` (seeded from the request seed and
the sequence's `sample_index`), so their tokens do not depend on the rest of the batch.
Logprobs are the model's raw log-softmax (before any processing), as vLLM v1 returns them.

Fast path: when every row only needs its temperature (one sample, no top-k/top-p/min-p, no seed,
no logprobs, no penalties, no pending min_tokens), `fast_temperatures` returns the per-row temperatures and
`sample_with_temperatures` draws all rows at once in one pass over the logits (Gumbel-max, the same
distribution as the general path's exponential race; an all-greedy batch is one argmax), reading
the temperatures from the step's uploaded inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

import torch

import kernels
from policies.outputs import ScheduledSeq
from policies.request import SamplingParams
from policies.sampling_path import device_sampling


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # len == num_samples
    # Per sampled token (when the request asked for logprobs): {token_id: logprob} holding the
    # sampled token and the top-`logprobs` tokens of the position.
    logprobs: list[dict[int, float]] | None = None


_SEQ, _NUM_SAMPLES = itemgetter(0), itemgetter(2)  # ScheduledSeq fields


def _stop_ids(s: ScheduledSeq, vocab_size: int) -> list[int]:
    sp = s.seq.request.sampling_params
    ids = set(sp.stop_token_ids)
    eos = s.seq.request.eos_token_id
    if eos is not None and not sp.ignore_eos:
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return [t for t in ids if t < vocab_size]


def sample_with_temperatures(logits: torch.Tensor, temperatures: torch.Tensor,
                             temperature_list: list[float]) -> torch.Tensor:
    """logits [R, V] (float32 or the model's bf16/fp16, read as is), temperatures [R] (0 = greedy;
    the same values on the host in `temperature_list`) -> tokens [R] int64 (unseeded draws). A
    tempered batch is one Gumbel-max pass over the logits (`kernels.sample_gumbel`) whose Philox
    seed comes from torch's global generator, so `torch.manual_seed` makes the draws reproducible."""
    if not any(temperature_list):
        return logits.argmax(dim=-1)
    return kernels.sample_gumbel(logits, temperatures, draw_seed(temperature_list))


def draw_seed(temperatures: list[float]) -> int:
    """A step's Philox seed for the fast path, drawn from torch's global generator only when some
    row is tempered (so `torch.manual_seed` fixes a run, at any tensor-parallel size); 0 otherwise."""
    if not any(temperatures):
        return 0
    return int(torch.randint(0, 2**31 - 1, ()))


def _exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / Exp(1) noise): an exact categorical draw per row."""
    return (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> generator of a seeded request

    def release(self, seq_ids) -> None:
        """Forget the generators of finished sequences."""
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)

    def _generator(self, s: ScheduledSeq) -> torch.Generator:
        gen = self.generators.get(s.seq.seq_id)
        if gen is None:
            seed = s.seq.request.sampling_params.seed
            if s.seq.sample_index:
                seed = hash((seed, s.seq.sample_index))  # ints hash the same in every process
            gen = torch.Generator(device=self.device).manual_seed(seed & ((1 << 63) - 1))
            self.generators[s.seq.seq_id] = gen
        return gen

    @staticmethod
    def fast_temperatures(sampled: list[ScheduledSeq]) -> list[float] | None:
        """Per-row temperatures if the fast path serves every row, else None. Runs at C speed over the
        rows: each distinct combination of the deciding fields is checked once."""
        counts = list(map(_NUM_SAMPLES, sampled))
        if counts.count(1) != len(counts):
            return None
        seqs = list(map(_SEQ, sampled))
        if not device_sampling(seqs):
            return None
        return [s.request.sampling_params.temperature for s in seqs]

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, sampled: list[ScheduledSeq]) -> list[SampleResult]:
        """logits [R, V] (any float dtype, one row per sampled sequence) -> one result per sequence."""
        params: list[SamplingParams] = [s.seq.request.sampling_params for s in sampled]
        counts = [s.num_samples for s in sampled]
        min_tok = [i for i, s in enumerate(sampled)
                   if s.seq.num_output_tokens < params[i].min_tokens]
        want_logprobs = any(p.logprobs is not None for p in params)
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        all_greedy = all(p.temperature == 0 for p in params)
        if all_greedy and not want_logprobs and not min_tok and not penalized:
            tokens = logits.argmax(dim=-1).tolist()
            return [SampleResult([t] * n) for t, n in zip(tokens, counts)]
        logits = logits.float()  # the model's logits may be bf16; log-softmax, top-p etc. run in float32
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        masked = [(i, t) for i in min_tok for t in _stop_ids(sampled[i], logits.shape[1])]
        if masked:
            rows, cols = zip(*masked)
            logits = logits.clone()
            logits[list(rows), list(cols)] = float("-inf")
        if penalized:
            logits = apply_penalties(logits, [sampled[i].seq for i in penalized], [params[i] for i in penalized],
                                     penalized)
        expand = None
        if any(n != 1 for n in counts):
            expand = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(self.device)
            logits = logits[expand]
            if raw_logprobs is not None:
                raw_logprobs = raw_logprobs[expand]
        row_params = [p for p, n in zip(params, counts) for _ in range(n)]
        row_seqs = [s for s, n in zip(sampled, counts) for _ in range(n)]
        tokens = logits.argmax(dim=-1)
        if not all_greedy:
            tokens = torch.where(self._tensor([p.temperature == 0 for p in row_params], torch.bool),
                                 tokens, self._sample(logits, row_params, row_seqs))
        token_list = tokens.tolist()
        lp = self._logprobs(raw_logprobs, tokens, row_params) if want_logprobs else None
        results, row = [], 0
        for n in counts:
            results.append(SampleResult(token_list[row:row + n], None if lp is None or lp[row] is None
                                        else lp[row:row + n]))
            row += n
        return results

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                seqs: list[ScheduledSeq]) -> torch.Tensor:
        vocab = logits.shape[1]
        temps = self._tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32)
        logits = logits / temps[:, None]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, self._tensor(top_k, torch.int64), self._tensor(top_p, torch.float32))
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = self._tensor([p.min_p for p in params], torch.float32)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_()
        seeded = [i for i, p in enumerate(params) if p.seed is not None and p.temperature > 0]
        start = 0
        while start < len(seeded):  # consecutive rows of one sequence draw from its generator at once
            end = start + 1
            while end < len(seeded) and seeded[end] == seeded[end - 1] + 1 \
                    and seqs[seeded[end]].seq is seqs[seeded[start]].seq:
                end += 1
            lo, hi = seeded[start], seeded[end - 1] + 1
            noise[lo:hi].exponential_(generator=self._generator(seqs[lo]))
            start = end
        return _exponential_race(probs, noise)

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor,
                  params: list[SamplingParams]) -> list[dict[int, float] | None]:
        k = min(max(p.logprobs or 0 for p in params), raw.shape[-1])  # never past the vocabulary
        chosen = raw.gather(1, tokens[:, None])[:, 0].tolist()
        top_lp, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], tokens[:, None][:, :0])
        top_lp, top_ids, token_list = top_lp.tolist(), top_ids.tolist(), tokens.tolist()
        out: list[dict[int, float] | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            d = dict(zip(top_ids[i][:p.logprobs], top_lp[i][:p.logprobs]))
            d[token_list[i]] = chosen[i]
            out.append(d)
        return out


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] int64: how often each token occurs in each list."""
    flat = [row * vocab + t for row, tokens in enumerate(token_lists) for t in tokens]
    index = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
    return torch.bincount(index, minlength=len(token_lists) * vocab).view(len(token_lists), vocab)


def apply_penalties(logits: torch.Tensor, seqs: list, params: list[SamplingParams], rows: list[int]) -> torch.Tensor:
    """vLLM's penalties on `logits[rows]` (float32 [R, V]; a new tensor is returned): a token seen in
    the prompt or the output has its logit divided by repetition_penalty if positive, else multiplied
    by it; then frequency_penalty * (its count in the output) and presence_penalty * (whether it
    occurs in the output) are subtracted."""
    vocab, device = logits.shape[1], logits.device
    out_counts = _token_counts([seq.token_ids[seq.num_prompt_tokens:] for seq in seqs], vocab, device)
    penalized = logits[rows]
    seen = out_counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_any = seen | (_token_counts([seq.token_ids[:seq.num_prompt_tokens] for seq in seqs], vocab, device) > 0)
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32).to(device)[:, None]
        factor = torch.where(penalized > 0, 1.0 / rep, rep)
        penalized = torch.where(seen_any, penalized * factor, penalized)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32).to(device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32).to(device)[:, None]
    penalized = penalized - freq * out_counts - pres * seen
    logits = logits.clone()
    logits[rows] = penalized
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus; one sort per batch."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    kth = sorted_logits.gather(1, (vocab - top_k)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p)[:, None]
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
