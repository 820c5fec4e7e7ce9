"""Shared by the engine model/runner tests: a tiny model of each architecture paired with the
transformers model holding the same weights, and a minimal block allocator that drives
`ModelRunner.execute` the way the scheduler would (no policies/ scheduler needed)."""
from __future__ import annotations

import dataclasses
import math

import torch
from transformers import AutoModelForCausalLM

import kernels.reference as ref
from engine.device.model_runner import ModelRunner
from engine.device.weights import build_model, to_hf_state_dict
from engine.model_loader import load_model_config
from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.request import Request, SamplingParams
from policies.sequence import Sequence

ARCHS = ("llama", "qwen2", "qwen3")


def hf_twin(model) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_config(model.config.to_hf_config(), dtype=torch.float32).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    return hf


def tiny_pair(arch: str, seed: int = 0, **overrides):
    cfg = dataclasses.replace(load_model_config(f"tiny-{arch}"), **overrides)
    model = build_model(cfg, ref, "cpu", torch.float32, seed=seed)
    return cfg, model, hf_twin(model)


@torch.no_grad()
def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of one sequence: [len, vocab]."""
    return hf(torch.tensor([token_ids])).logits[0].float()


def random_prompts(lens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


class BlockAllocator:
    """Hands out GPU blocks in order and grows block tables; enough for tests."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))

    def ensure(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self.free.pop(0))

    def release(self, seq: Sequence) -> None:
        self.free.extend(seq.block_table)
        seq.block_table = []


def make_seqs(prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
              eos_token_id: int | None = None) -> list[Sequence]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    return [Sequence.from_request(i, Request(f"r{i}", p, sp, eos_token_id=eos_token_id))
            for i, (p, sp) in enumerate(zip(prompts, plist))]


def step(runner: ModelRunner, alloc: BlockAllocator, seqs: list[Sequence], chunk: int,
         out: SchedulerOutput | None = None) -> dict:
    """Schedule up to `chunk` new tokens of every seq, execute, and apply the results."""
    out = out or SchedulerOutput(now=0.0)
    for seq in seqs:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        alloc.ensure(seq, seq.num_computed_tokens + n)
        done = seq.num_computed_tokens + n == seq.num_tokens
        out.scheduled.append(ScheduledSeq(seq, n, 1 if done else 0))
    results = runner.execute(out)
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.seq.seq_id in results:
            s.seq.token_ids.extend(results[s.seq.seq_id].token_ids)
    return results


def generate(runner: ModelRunner, seqs: list[Sequence], max_tokens: int, chunk: int = 1 << 30,
             alloc: BlockAllocator | None = None) -> list[list[int]]:
    alloc = alloc or BlockAllocator(runner.block_size, runner.num_gpu_blocks)
    while any(s.num_output_tokens < max_tokens for s in seqs):
        step(runner, alloc, [s for s in seqs if s.num_output_tokens < max_tokens], chunk)
    return [s.output_token_ids for s in seqs]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)
