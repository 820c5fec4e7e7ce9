"""Per-step host overhead of the real engine that `ModelRunner.execute` does not include: the whole
`LLMEngine.step()` (scheduler `schedule` + `update` with the trace recorder on, the sampled-token
dict, stop rules, request outputs) around an instant runner that returns every sampled token at
once. Measured in the state a step of the given shape runs in: D running decodes (all decoding)
plus, for P > 0, one waiting prompt of P tokens that the measured step admits.

This is pure CPU work, so it is measured apart from the GPU step and added to it (profile column
`host_s`); `time_s = forward_s + host_s` is the step period the engine loop pays. It is measured on
the machine that runs the profile, whose CPU is the engine's.
"""
from __future__ import annotations

import random
import statistics
import time

from engine.config import ModelConfig
from engine.engine_args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampler import SampleResult
from policies import SamplingParams, SchedulerOutput, TraceRecorder

DECODE_PROMPT_LEN = 16
_PARAMS = SamplingParams(temperature=1.0, max_tokens=1 << 20, ignore_eos=True)


class InstantRunner:
    """ModelRunner's interface without a model: token 1 for every sampled row, no device work."""

    def __init__(self, num_gpu_blocks: int, vocab_size: int) -> None:
        self.num_gpu_blocks, self.num_cpu_blocks, self.vocab_size = num_gpu_blocks, 0, vocab_size

    def execute(self, out: SchedulerOutput) -> dict[int, SampleResult]:
        return {s.seq.seq_id: SampleResult([1] * s.num_samples) for s in out.scheduled if s.num_samples}

    def release(self, seq_ids) -> None:
        pass


def host_overhead(model: ModelConfig, num_prefill_tokens: int, num_decode_seqs: int, block_size: int,
                  repeats: int, seed: int = 0) -> float:
    """Median seconds of `LLMEngine.step()` (instant runner) for a step with `num_decode_seqs`
    decodes and a new prompt of `num_prefill_tokens` tokens (0: a steady-state decode step)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is invalid: must be >= 1")
    rng = random.Random(seed)
    high = min(10000, model.vocab_size)
    max_len = DECODE_PROMPT_LEN + num_prefill_tokens + 4 * repeats + 64
    blocks = (num_decode_seqs + repeats + 1) * (max_len // block_size + 2)
    args = EngineArgs(model=model, device="cpu", max_num_batched_tokens=max(
        num_prefill_tokens + num_decode_seqs + repeats + DECODE_PROMPT_LEN, DECODE_PROMPT_LEN * max(1, num_decode_seqs)),
        max_num_seqs=num_decode_seqs + repeats + 1, max_model_len=max_len, block_size=block_size,
        num_gpu_blocks=blocks, swap_space=0, detokenize=False, seed=seed)  # fmt: skip
    engine = LLMEngine(args, TraceRecorder(), runner=InstantRunner(blocks, model.vocab_size))

    def prompt(n: int) -> list[int]:
        return [rng.randrange(high) for _ in range(n)]

    for i in range(num_decode_seqs):
        engine.add_request(f"d{i}", prompt(DECODE_PROMPT_LEN), _PARAMS)
    while engine.scheduler.num_waiting:
        engine.step()
    if num_decode_seqs:  # one plain decode step so every running sequence is decoding
        engine.step()
    times = []
    for r in range(repeats):
        if num_prefill_tokens:
            engine.add_request(f"p{r}", prompt(num_prefill_tokens), _PARAMS)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        got = engine.recorder.steps[-1]["num_prefill_tokens"]
        if got != num_prefill_tokens:
            raise RuntimeError(f"host-overhead step scheduled {got} prefill tokens, "
                               f"expected {num_prefill_tokens}: the engine state is not what was built")
    return statistics.median(times)
