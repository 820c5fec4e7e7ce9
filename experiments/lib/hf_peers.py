"""transformers as the peer of `bench_throughput`: the same requests through transformers'
continuous batching (`generate_batch`'s manager) and through padded `generate`.

Both run a transformers model of the same architecture and dtype (its own random weights: with
`ignore_eos` the token values do not change the work). Counted tokens are the ones each request
asked for (`max_tokens`), as for our engine.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass(slots=True)
class PeerResult:
    name: str
    num_requests: int
    output_tokens: int  # tokens the requests asked for (what tok/s counts)
    computed_tokens: int  # tokens actually generated (padded generate computes more)
    seconds: float
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def hf_model(cfg: ModelConfig, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg.to_hf_config(), dtype=dtype)
    return model.eval()


def _generation_config(temperature: float, max_new_tokens: int):
    from transformers import GenerationConfig

    sample = temperature > 0
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample,
                            temperature=temperature if sample else None, top_k=0 if sample else None,
                            top_p=1.0 if sample else None, eos_token_id=None, pad_token_id=0)


@torch.no_grad()
def continuous_batching(model, prompts: list[list[int]], max_tokens: list[int],
                        temperature: float) -> PeerResult:
    """transformers' continuous batching as `generate_batch` runs it (its context manager: warm-up
    and CUDA-graph capture first, outside the timed region as our engine's are), but with each
    request's own max_new_tokens (generate_batch takes one for all)."""
    config = _generation_config(temperature, max(max_tokens))
    params = inspect.signature(model.continuous_batching_context_manager).parameters
    kwargs = {"generation_config": config, "block": True}
    if "warmup" in params:
        kwargs["warmup"] = True
    if "workload_hints" in params:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                                                 max_generated_length=max(max_tokens), num_requests=len(prompts))
    with model.continuous_batching_context_manager(**kwargs) as manager:
        if "warmup" not in params:  # older transformers: warm the same manager up by hand
            _drain(manager, [p[:64] for p in prompts[:4]], [8] * min(4, len(prompts)), "warm")
        _sync()
        start = time.perf_counter()
        done = _drain(manager, prompts, max_tokens, "req")
        _sync()
        seconds = time.perf_counter() - start
    return PeerResult("transformers generate_batch (continuous batching)", len(prompts), sum(max_tokens),
                      sum(done.values()), seconds, "its context manager, per-request max_new_tokens")


def _drain(manager, prompts: list[list[int]], max_tokens: list[int], prefix: str) -> dict[str, int]:
    """Add the requests, wait for all of them; returns request id -> generated tokens."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        manager.add_request(prompt, request_id=f"{prefix}-{i}", max_new_tokens=n)
    done: dict[str, int] = {}
    while len(done) < len(prompts):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"transformers continuous batching failed: {result.error}")
            done[result.request_id] = len(result.generated_tokens)
        elif result is None and not manager.is_running():
            raise RuntimeError("transformers continuous batching stopped before finishing")
    return done


@torch.no_grad()
def padded_generate(model, prompts: list[list[int]], max_tokens: list[int], temperature: float,
                    batch_size: int) -> PeerResult:
    """Static batches of `batch_size`, left-padded; each batch runs to its longest request."""
    device = next(model.parameters()).device
    computed, seconds = 0, 0.0
    for lo in range(0, len(prompts), batch_size):
        batch, lens = prompts[lo:lo + batch_size], max_tokens[lo:lo + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        config = _generation_config(temperature, max(lens))
        config.min_new_tokens = max(lens)
        ids, mask = ids.to(device), mask.to(device)
        _sync()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, generation_config=config)
        _sync()
        seconds += time.perf_counter() - start
        computed += (out.shape[1] - width) * len(batch)
    return PeerResult(f"transformers generate (padded, batch {batch_size})", len(prompts), sum(max_tokens),
                      computed, seconds, "each batch runs to its longest request")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
