"""nano-vllm's offline throughput benchmark (bench.py), drawn exactly as it does:

    seed(0)
    prompt_token_ids = [[randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    sampling_params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, max_output_len))
                       for _ in range(num_seqs)]

With 256 requests and max_input_len = max_output_len = 1024 that is 142,827 prompt tokens and
133,966 output tokens. All requests arrive at t = 0.
"""
from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from experiments.lib.workloads.base import WORKLOADS, Workload, WorkloadConfig
from experiments.lib.workloads.common import COUNT, LENGTH, PromptMemory, get_int, make_request

MAX_TOKEN_ID = 10000  # randint(0, 10000) is inclusive


@dataclass(kw_only=True)
class NanovllmWorkloadConfig(WorkloadConfig):
    max_input_len: int | None = None
    max_output_len: int | None = None


@WORKLOADS.register("nanovllm", config=NanovllmWorkloadConfig)
def build(cfg: Mapping[str, Any], seed: int, vocab_size: int, where: str = "workload") -> Workload:
    num_seqs = get_int(cfg, "num_requests", where, 1, COUNT)
    max_input_len = get_int(cfg, "max_input_len", where, 100, LENGTH)
    max_output_len = get_int(cfg, "max_output_len", where, 100, LENGTH)
    longest = num_seqs * max_input_len  # randint makes each id an int object of its own
    PromptMemory().add(longest, longest, f"{where}.num_requests={num_seqs} x {where}.max_input_len={max_input_len} "
                       "(the longest the prompts may be)", "lower one of them")
    if vocab_size <= MAX_TOKEN_ID:
        raise ValueError(f"workload.kind='nanovllm' draws token ids up to {MAX_TOKEN_ID}: "
                         f"model.vocab_size={vocab_size} is too small (pick a real model shape)")
    rng = random.Random(seed)  # same Mersenne Twister stream as random.seed(seed)
    randint = rng.randint
    prompts = [[randint(0, MAX_TOKEN_ID) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    outputs = [randint(100, max_output_len) for _ in range(num_seqs)]
    requests = [make_request(str(i), p, o, None, 0.0, 0, temperature=0.6)
                for i, (p, o) in enumerate(zip(prompts, outputs))]
    return Workload(str(cfg.get("name", "nanovllm")), requests, outputs)
