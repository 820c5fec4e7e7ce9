"""`LLM`: vLLM's offline entry point. `LLM(model=...).generate(prompts, sampling_params)` adds every
prompt to an `LLMEngine`, steps it until all are done, and returns the outputs in input order."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from engine.offline.outputs import RequestOutput
from policies.request import SamplingParams

Prompt = str | list[int] | dict[str, Any]  # text, token ids, {"prompt": text} or {"prompt_token_ids": ids}
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_ALLOWED = ("a string, a non-empty list of token ids, {'prompt': str} or {'prompt_token_ids': [int, ...]}")


def _is_token_ids(p: object) -> bool:
    if not isinstance(p, (list, tuple)) or not p:
        return False
    # One pass in C over the element types (a server's prompt is hundreds of ids, checked on the
    # way to its first token); the per-element test only where some id is not a plain int.
    return set(map(type, p)) == {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[str | list[int]]:
    """One prompt or a sequence of them -> a list of strings and token-id lists (vLLM's forms:
    text, token ids, or the dicts `TextPrompt` / `TokensPrompt`). ValueError naming the prompt's
    index on anything else."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [parse_prompt(prompts, "prompts")]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
            f"prompts={prompts!r:.60} is invalid: must be one prompt ({_ALLOWED}) or a list of them")
    if not prompts:
        raise ValueError("prompts=[] is invalid: give at least one prompt")
    return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def parse_prompt(p: object, name: str) -> str | list[int]:
    """One prompt in any of vLLM's forms -> text or token ids; ValueError naming `name` otherwise."""
    if isinstance(p, dict):
        unknown = sorted(set(p) - set(_PROMPT_KEYS), key=str)
        if unknown or len(p) != 1:
            raise ValueError(f"{name}={p!r:.60} is invalid: a dict prompt holds exactly one of the keys "
                             f"{_PROMPT_KEYS}" + (f" (unknown: {unknown})" if unknown else ""))
        key, value = next(iter(p.items()))
        if key == "prompt" and isinstance(value, str):
            return value
        if key == "prompt_token_ids" and _is_token_ids(value):
            return list(value)
        allowed = "a string" if key == "prompt" else "a non-empty list of token ids"
        raise ValueError(f"{name}[{key!r}]={value!r:.60} is invalid: must be {allowed}")
    if isinstance(p, str):
        return p
    if _is_token_ids(p):
        return list(p)
    raise ValueError(f"{name}={p!r:.60} is invalid: each prompt must be {_ALLOWED}")


class LLM:
    def __init__(self, model: str, disaggregation: str | dict | None = None, **engine_args: Any) -> None:
        """`disaggregation`: e.g. "prefill=1,decode=1": a prefill engine here and a decode engine in a
        process of its own on the next GPU, KV blocks moved between them (engine/disagg/,
        docs/disaggregation.md); None: one engine."""
        args = EngineArgs.from_dict({"model": model, **engine_args})
        if disaggregation is None:
            self.engine = LLMEngine(args)
        else:
            from engine.disagg.pd_engine import DisaggregatedEngine

            self.engine = DisaggregatedEngine(args, disaggregation)
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
                 use_tqdm: bool = True, tenant: str | None = None) -> list[RequestOutput]:
        """Run every prompt to its end; outputs in input order. A prompt is text, a list of token
        ids, `{"prompt": text}` or `{"prompt_token_ids": ids}`; one prompt or a list of them. Bad
        input (a malformed prompt, one over max_model_len, an out-of-vocabulary id, bad sampling
        parameters) raises ValueError naming the prompt's index, and nothing of the call runs.
        `tenant`: the client every prompt of the call is served for (fair-share policies, per-tenant
        metrics in the engine's trace)."""
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
        # As vLLM's LLM: only each request's final output comes out of the engine (no per-step work).
        final = {id(sp): dataclasses.replace(sp, output_kind="final_only") for sp in params
                 if isinstance(sp, SamplingParams) and sp.output_kind != "final_only"}
        params = [final.get(id(sp), sp) for sp in params]
        request_ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        for i, (request_id, prompt, sp) in enumerate(zip(request_ids, prompt_list, params)):
            try:
                self.engine.add_request(request_id, prompt, sp, tenant=tenant)
            except ValueError as e:
                # As vLLM: one bad prompt rejects the whole call before any work. The prompts queued
                # before it are aborted (never scheduled) and their outputs collected here.
                for queued in request_ids[:i]:
                    self.engine.abort_request(queued)
                while self.engine.has_unfinished_requests():
                    self.engine.step()
                raise ValueError(f"prompts[{i}]: {e} (no prompt of this call was run)") from None
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
