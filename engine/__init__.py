"""servelab's real backend: executes the scheduler's `SchedulerOutput`s on a GPU (or the CPU, fp32)
with a paged KV cache and the kernels of `kernels/`.

Rooms, each on one side of one boundary: `engine.device` (executing one step on the device),
`engine.models` and `engine.distributed` (the forward; tensor parallelism), `engine.offline`
(`LLMEngine`, `LLM`: a caller steps the engine), `engine.online` (`AsyncLLMEngine` and the hosts
that step the engine for a server: a thread, or the engine core's process), `engine.serving` and
`engine.serve` (HTTP). `engine.config` (a leaf), `engine.engine_args` and `engine.model_loader` are
shared by all.

Lower half (model execution), for `LLMEngine` / `LLM` to build on:

- `engine.config`: `ModelConfig` (the shared `policies.model_shape.ModelShape`, conf/model yaml
  schema, plus what the engine needs: `ModelConfig.from_hf_config(...)`, `.to_hf_config()`,
  `.eos_token_id`), `CacheConfig(block_size=16, gpu_memory_utilization=0.9, swap_space=4.0 GiB,
  num_gpu_blocks=None)`, `RunnerConfig` and `ParallelConfig`. `engine.model_loader`:
  `load_model_config(name_or_dir_or_gguf, dtype=None)`.
- `engine.device.model_runner.ModelRunner(model_config, cache_config, *, max_num_batched_tokens,
  max_num_seqs, max_model_len, device="cpu", dtype=None, enforce_eager=False, seed=0,
  attention_backend="auto", compile_model=None)`:
  - builds the model (weights per `model_config.weights`; `seed` seeds dummy weights), sizes and
    allocates the KV cache, captures CUDA graphs of whole steps (GPU, unless `enforce_eager`;
    decode-only buckets in `.graphs.sizes`, token-count buckets of steps with prefill tokens in
    `.graphs.token_sizes`). `dtype=None`: the model config's dtype on CUDA, float32 on CPU.
    `compile_model=None`: torch.compile the elementwise ops on CUDA unless `enforce_eager`.
    `attention_backend`: "auto" (Triton on CUDA, torch references on CPU), "triton", "reference".
  - `.num_gpu_blocks`, `.num_cpu_blocks`: give these to `policies.make_block_manager(...)`.
    Raises ValueError if one `max_model_len` request does not fit (blocks needed vs. blocks fitting).
  - `.execute(out: SchedulerOutput) -> dict[seq_id, SampleResult]`: swap_out, swap_in, copy, then
    the forward over `out.scheduled` (positions `[seq.num_computed_tokens, +num_new_tokens)`; it
    does not modify any Sequence). One entry per scheduled seq with `num_samples > 0`:
    `SampleResult.token_ids` (len == num_samples; feed `{seq_id: r.token_ids}` to
    `scheduler.update`) and `SampleResult.logprobs` (None, or per token `{token_id: logprob}`:
    the sampled token plus the top-`SamplingParams.logprobs`; raw model log-softmax).
    Sampling reads `seq.request.sampling_params`, `seq.request.eos_token_id` (for min_tokens)
    and `seq.num_output_tokens`, `seq.sample_index` (seeded generator of each parallel sample).
  - `.release(seq_ids)`: call for sequences that finished or were aborted (drops seeded generators).
  - `.vocab_size`, `.model`, `.kv_cache`, `.sampler`, `.device`, `.dtype`, `.block_size`.
- `engine.device.sampler`: `Sampler`, `SampleResult`. `engine.device.kv_cache`: `KVCache` (per-layer
  `k_caches`/`v_caches` on the device, `cpu_k_caches`/`cpu_v_caches` swap pool, `apply(...)`).
- `engine.device.weights`: `build_model`, `load_hf_state_dict`, `to_hf_state_dict` (our weights under
  transformers' names: load them into `AutoModelForCausalLM.from_config(cfg.to_hf_config())`).
- `engine.device.input_batch`: SchedulerOutput -> flattened varlen batch (decode rows, then prefill rows),
  written with numpy into pinned buffers (`engine.device.batch_layout`) and copied to the device at once.

Upper half (the user API, vLLM's names), importable from `engine` directly:

- `LLM(model, **engine_args).generate(prompts, sampling_params=None, use_tqdm=True,
  tenant=None)`: prompts are strings, token-id lists, or a mix; one `SamplingParams` or one per prompt; returns
  `RequestOutput`s in input order. `LLM.from_engine(engine)` wraps an existing engine.
- `LLMEngine(EngineArgs(...), recorder=None, build_scheduler=None)`: `add_request(request_id, prompt,
  sampling_params, arrival_time=None, priority=0, output_len=None, abort_too_long=False, tenant=None)`,
  `abort_request(id) -> bool` (both safe from another thread than the stepping one),
  `step() -> list[RequestOutput]` (every request that made progress in the step, in its
  `SamplingParams.output_kind`: cumulative, delta, or final_only = only when it ends; `finished`
  marks the last output, aborted ones included),
  `has_unfinished_requests()`, `reset(...)` (fresh scheduler and clock, same model and KV cache),
  `.scheduler`, `.recorder` (the scheduler's trace), `.runner`, `.tokenizer`, `.now()`.
- `EngineArgs`: model (conf/model name, HF dir, .gguf, or a `ModelConfig`), dtype, device,
  tokenizer, detokenize, block_manager, block_manager_config (its own knobs), policy, policy_config
  (the policy's arguments: `LLM(model, policy="srpt", policy_config={"aging": 1.0})`),
  preemption_mode, scheduler limits, block_size,
  gpu_memory_utilization, swap_space, num_gpu_blocks, enforce_eager, seed (of the dummy weights: an
  integer in [-2**63, 2**63 - 1]; None is the default 0), max_logprobs, tensor_parallel_size
  (shard the model over N GPUs: `engine.distributed`, docs/parallelism.md), distributed_timeout_s,
  disable_custom_all_reduce / custom_all_reduce_one_shot_max_bytes / custom_all_reduce_max_bytes
  (small all-reduces over symmetric memory, NCCL above: docs/parallelism.md), all_reduce_kernel
  ("torch", "triton", "triton_fused" or "triton_lamport": whose kernels sum over symmetric memory),
  sequence_parallel_min_rows (steps of that many tokens run sequence-parallel, eagerly; 0: off).
- `RequestOutput(request_id, prompt, prompt_token_ids, outputs: [CompletionOutput(index, text,
  token_ids, finish_reason, stop_reason, logprobs)], finished, metrics: RequestMetrics,
  num_cached_tokens, error)`; `error` is set when the engine failed that request alone ("abort:error").
- `AsyncLLMEngine(engine, max_waiting_requests=None)` / `.from_engine_args(args, ...,
  engine_process=False)` (True: the engine in its own process, engine/online/engine_core.py): `async for out
  in generate(prompt, sampling_params, request_id, priority=0, output_kind="cumulative"|"delta", tenant=None)`,
  `abort(id)`, `is_running`, `errored`, `check_health()`, `stats() -> EngineStats`,
  `add_finished_observer(fn)` (`RequestStats` per ended request), `tokenizer`, `model_name`,
  `max_model_len`, `vocab_size`, `engine_process`, `shutdown()`; `EngineQueueFullError`, `EngineDeadError`.
- `engine.offline.tokenizer` / `engine.offline.detokenizer`: tokenizer from an HF dir or GGUF file; incremental
  detokenization and vLLM's stop-string rule (text truncated before the stop string).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"LLM": "engine.offline.llm", "LLMEngine": "engine.offline.llm_engine", "EngineArgs": "engine.engine_args",
            "AsyncLLMEngine": "engine.online.async_llm_engine",
            "RequestOutput": "engine.offline.outputs", "CompletionOutput": "engine.offline.outputs",
            "RequestMetrics": "engine.offline.outputs", "SamplingParams": "policies.request"}


def __getattr__(name: str) -> Any:
    # Lazy: `import engine.config` stays light; `from engine import LLM` loads the model stack.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["LLM", "AsyncLLMEngine", "CompletionOutput", "EngineArgs", "LLMEngine", "RequestMetrics", "RequestOutput",
           "SamplingParams"]
