"""Per-step host overhead of the real engine that the profiler's tight-loop `execute` timing does not
include, measured in place: an `LLMEngine` drives the profiler's own runner (real forwards on the
real device). For each (prefill tokens P, decodes D) pair, the host share of a step is the median
wall time of consecutive `LLMEngine.step()` calls minus the median time of the same kind of step's
`execute` re-run back to back (warm, as the profile's grid times it; the re-runs happen before the
scheduler updates: same tokens, same slots, so they rewrite identical KV). That covers scheduler
`schedule` + `update` with the trace recorder on, the sampled-token dict, stop rules, request
outputs, and any difference between `execute` run between those and in a tight loop. On an H200
the two disagree in sign: a standalone check at 10 decodes found the engine's execute slower than
warm re-runs (2.12 vs 2.01 ms), while this measurement gave host_s of -36 to -137 us at 1-128
decodes (unexplained).

State of a measured step: D running decodes (all decoding) plus, for P > 0, one waiting prompt of
P tokens that the step admits (aborted after it, so D stays D).

`time_s = forward_s + host_s` is then the step period the engine loop pays.

`pipelined_period` times a step as async scheduling runs it: launched again and again without
waiting for its tokens, so the host's launch work overlaps the device's.

`admission_time` times `LLMEngine.add_request` itself: the host work per arriving request, which the
serving loop pays before its next step (a burst of N requests at once: N of them).

`decode_periods` measures decode-only rows directly as that period: an engine holding D running
sequences at the row's contexts times its own consecutive steps. On an H200 the composed estimate
fell 5-17% short of the decode steps of real engine runs (the fidelity scenarios), growing with D: the runner's host work (step plan, input writes, sampling bookkeeping)
runs slower between scheduler calls than back to back in a tight loop, a cache effect the
difference of medians above did not capture.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterable

import torch

from engine.device.model_runner import ModelRunner
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from experiments.lib.profiling.synthetic import decode_contexts
from policies import SamplingParams, TraceRecorder

DECODE_PROMPT_LEN = 16
_PARAMS = SamplingParams(temperature=1.0, max_tokens=1 << 20, ignore_eos=True, output_kind="final_only")
_PROBE_ITEMS = list(range(4000, 0, -1))


def cpu_probe_us(repeats: int = 15) -> float:
    """Median microseconds of a fixed pure-Python workload (dict and list work of the kind the
    scheduler does): a gauge of the host CPU's current speed, logged next to timings because the
    device VMs' vCPUs drift by up to 2.5x within a call (docs/history.md)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        index = {v: i for i, v in enumerate(_PROBE_ITEMS)}
        sorted(_PROBE_ITEMS, key=index.__getitem__)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class _TimedRunner:
    """Forwards to the runner; with `reruns` > 0 an `execute` is then re-run that many times back to
    back (results dropped) and the re-runs' median kept as `warm_s`."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.reruns, self.warm_s = runner, 0, 0.0
        self.num_gpu_blocks, self.num_cpu_blocks = runner.num_gpu_blocks, runner.num_cpu_blocks
        self.vocab_size = runner.vocab_size
        self._sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda *_: None)

    def execute(self, out):
        result = self.runner.execute(out)
        if self.reruns:
            times = []
            for _ in range(self.reruns):
                t0 = time.perf_counter()
                self.runner.execute(out)
                self._sync(self.runner.device)
                times.append(time.perf_counter() - t0)
            self.warm_s = statistics.median(times)
        return result

    def release(self, seq_ids) -> None:
        self.runner.release(seq_ids)


def host_overheads(runner: ModelRunner, pairs: Iterable[tuple[int, int]], warmup: int, repeats: int,
                   seed: int = 0) -> dict[tuple[int, int], float]:
    """{(P, D): seconds of host work per step} for steps of D decodes and a P-token prompt, on an
    engine with the runner's limits: the median wall time of `repeats` consecutive engine steps
    minus the median of one more step's execute re-run `repeats` times back to back (warm, as the
    profile's grid times it). Timing noise can make a near-zero overhead slightly negative."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is invalid: must be >= 1")
    rng = random.Random(seed)
    high = min(10000, runner.vocab_size)
    timed = _TimedRunner(runner)
    engine = _engine(timed, runner, seed)
    out: dict[tuple[int, int], float] = {}
    for p, d in pairs:
        if p + d > runner.max_num_batched_tokens or d + (p > 0) > runner.max_num_seqs:
            raise ValueError(f"host step of {p} prefill tokens + {d} decodes is invalid: over the runner's "
                             f"limits ({runner.max_num_batched_tokens} tokens, {runner.max_num_seqs} sequences)")
        engine.reset(TraceRecorder())
        for i in range(d):
            engine.add_request(f"d{i}", [rng.randrange(high) for _ in range(DECODE_PROMPT_LEN)], _PARAMS)
        while engine.scheduler.num_waiting:
            engine.step()
        if d:
            engine.step()  # every running sequence decoding
        walls = []
        for r in range(warmup + repeats + 1):
            if p:
                engine.add_request(f"p{r}", [rng.randrange(high) for _ in range(p)], _PARAMS)
            warm_phase = r == warmup + repeats  # the last step: its execute re-run back to back
            timed.reruns = repeats if warm_phase else 0
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            got = engine.recorder.steps[-1]["num_prefill_tokens"]
            if got != p:
                raise RuntimeError(f"host-overhead step scheduled {got} prefill tokens, expected {p}: "
                                   "the engine state is not what was built")
            if p:
                engine.abort_request(f"p{r}")
            if warmup <= r < warmup + repeats:
                walls.append(wall)
        timed.reruns, warm_s = 0, timed.warm_s
        _abort_decodes(engine, d)
        out[(p, d)] = statistics.median(walls) - warm_s
    return out


def _engine(wrapped, runner: ModelRunner, seed: int, async_scheduling: bool = False) -> LLMEngine:
    """An engine with the runner's limits driving `wrapped` (the runner or a wrapper of it)."""
    args = EngineArgs(model=runner.model_config, device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
                      max_num_batched_tokens=runner.max_num_batched_tokens, max_num_seqs=runner.max_num_seqs,
                      max_model_len=runner.max_model_len, block_size=runner.block_size,
                      num_gpu_blocks=runner.num_gpu_blocks, swap_space=0, detokenize=False, seed=seed,
                      async_scheduling=async_scheduling)  # fmt: skip
    return LLMEngine(args, TraceRecorder(), runner=wrapped)


def pipelined_period(runner: ModelRunner, out, warmup: int, repeats: int) -> float:
    """Seconds per step of `out` launched `repeats` times back to back with no wait for its tokens
    (async scheduling's steady state: the larger of the runner's host work and the device's)."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda *_: None)
    for _ in range(warmup):
        runner.launch(out)
    sync(runner.device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        runner.launch(out)
    sync(runner.device)
    return (time.perf_counter() - t0) / repeats


def admission_time(runner: ModelRunner, repeats: int, seed: int = 0, num_requests: int = 64,
                   prompt_len: int = 512) -> float:
    """Seconds of host work per request `LLMEngine.add_request` takes on an idle engine (the median
    over `repeats` rounds of each round's mean over `num_requests` adds), with the arguments a workload
    replay passes (experiments/lib/engine_backend.py); the prompts are built before the clock starts."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is invalid: must be >= 1")
    rng = random.Random(seed)
    high = min(10000, runner.vocab_size)
    engine = _engine(runner, runner, seed)
    prompt_len = min(prompt_len, runner.max_model_len - 1)
    per_request = []
    for r in range(repeats):
        engine.reset(TraceRecorder())
        prompts = [[rng.randrange(high) for _ in range(prompt_len)] for _ in range(num_requests)]
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"a{r}-{i}", prompt, _PARAMS, arrival_time=0.0, output_len=16, abort_too_long=True)
        per_request.append((time.perf_counter() - t0) / num_requests)
        for i in range(num_requests):
            engine.abort_request(f"a{r}-{i}")
        engine.step()  # hands out the aborted requests' outputs
    return statistics.median(per_request)


def _abort_decodes(engine: LLMEngine, num: int) -> None:
    """Abort requests d0..d{num-1}, then step once: that hands out their outputs, so the next
    reset() finds none in flight."""
    for i in range(num):
        engine.abort_request(f"d{i}")
    engine.step()


def prompt_lens(contexts: list[int], budget: int) -> list[int]:
    """Prompt lengths whose sequences reach `contexts` (new token included) when the last prompt's
    prefill ends: a prompt prefilled early keeps decoding, one token per step, while the later ones
    are prefilled in chunks of the remaining token budget (FCFS), so it starts that much shorter.
    Found by two rounds of a step-by-step replay of that schedule (short prompts grow little)."""
    prompts = [n - 1 for n in contexts]
    for _ in range(2):
        done_at, left, step = [], list(prompts), 0  # done_at[i]: the step that samples i's first token
        while len(done_at) < len(prompts):
            room = max(1, budget - len(done_at))  # decodes come first (the engine keeps max_num_seqs < budget)
            while len(done_at) < len(prompts) and room > 0:
                i = len(done_at)
                take = min(room, left[i])
                left[i] -= take
                room -= take
                if left[i] == 0:
                    done_at.append(step)
            step += 1
        prompts = [max(1, n - 1 - (step - 1 - d)) for n, d in zip(contexts, done_at)]
    return prompts


def decode_periods(runner: ModelRunner, shapes: Iterable[tuple], warmup: int, repeats: int,
                   seed: int = 0, async_scheduling: bool = False) -> dict[tuple, float]:
    """{(D, C) or (D, C, ratio): median wall time of `repeats` consecutive engine steps of D decodes
    whose contexts spread around C as the grid's synthetic steps of that context ratio do (None or
    no ratio: the C/4..7C/4 spread)}; the prompts are prefilled first (contexts
    then grow by one token per step, `warmup + repeats` in all). Requests carry an `output_len`, as
    workload replays do, so the stop-length path runs too. `async_scheduling`: the engine schedules
    each step while the one before it runs, so a period is the larger of host and device work."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is invalid: must be >= 1")
    rng = random.Random(seed)
    high = min(10000, runner.vocab_size)
    engine = _engine(runner, runner, seed, async_scheduling)
    out: dict[tuple[int, int], float] = {}
    for shape in shapes:
        d, c, ratio = (*shape, None)[:3]
        lens = decode_contexts(d, c, ratio)
        if d > runner.max_num_seqs or max(lens) + warmup + repeats > runner.max_model_len:
            raise ValueError(f"decode period of {d} sequences at {c} tokens is invalid: over the runner's "
                             f"limits ({runner.max_num_seqs} sequences, max_model_len={runner.max_model_len})")
        engine.reset(TraceRecorder())
        for i, n in enumerate(prompt_lens(lens, runner.max_num_batched_tokens)):
            engine.add_request(f"d{i}", [rng.randrange(high) for _ in range(n)], _PARAMS,
                               output_len=runner.max_model_len)
        for _ in range(sum(lens) + d):  # prefill in chunks, then the first decode step of all
            engine.step()
            last = engine.recorder.steps[-1]
            if last["num_prefill_tokens"] == 0 and last["num_decode_seqs"] == d:
                break
        walls = []
        for r in range(warmup + repeats):
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            last = engine.recorder.steps[-1]
            if last["num_prefill_tokens"] or last["num_decode_seqs"] != d:
                raise RuntimeError(f"decode-period step ran {last['num_decode_seqs']} decodes and "
                                   f"{last['num_prefill_tokens']} prefill tokens, expected {d} decodes only "
                                   "(KV cache too small for the shape?)")
            if r >= warmup:
                walls.append(wall)
        _abort_decodes(engine, d)
        out[tuple(shape)] = statistics.median(walls)
    return out
