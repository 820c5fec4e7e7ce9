"""`LLM`: vLLM's offline entry point. `LLM(model=...).generate(prompts, sampling_params)` adds every
prompt to an `LLMEngine`, steps it until all are done, and returns the outputs in input order."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from engine.engine_args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from policies.request import SamplingParams

Prompt = str | list[int]


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and not (isinstance(p, (list, tuple)) and p
                                           and all(isinstance(t, int) for t in p)):
            raise ValueError(f"prompts[{i}]={p!r:.60} is invalid: each prompt must be a string or a "
                             "non-empty list of token ids")
    return [p if isinstance(p, str) else list(p) for p in prompts]


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs.from_dict({"model": model, **engine_args}))
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (benchmarks share one engine between LLM and experiment runs)."""
        llm = cls.__new__(cls)
        llm.engine, llm._ids = engine, itertools.count()
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params)} entries: must be one SamplingParams "
                                 f"or one per prompt ({len(prompt_list)})")
        request_ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        try:
            for request_id, prompt, sp in zip(request_ids, prompt_list, params):
                self.engine.add_request(request_id, prompt, sp)
        except ValueError:
            for request_id in request_ids:  # a bad prompt: nothing of this call stays queued
                self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():  # collect the aborted outputs
                self.engine.step()
            raise
        return self._run(request_ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        out_tokens = 0
        with bar:
            while len(done) < len(wanted) and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        done[output.request_id] = output
                        out_tokens += output.num_output_tokens
                        bar.update(1)
                        elapsed = max(bar.format_dict["elapsed"], 1e-9)
                        bar.set_postfix_str(f"output {out_tokens / elapsed:.0f} tok/s", refresh=False)
        missing = [r for r in request_ids if r not in done]
        if missing:
            raise RuntimeError(f"requests {missing[:5]} ended without an output: the engine lost them")
        return [done[r] for r in request_ids]
