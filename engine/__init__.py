"""servelab's real backend: executes the scheduler's `SchedulerOutput`s on a GPU (or the CPU, fp32)
with a paged KV cache and the kernels of `kernels/`.

Lower half (model execution), for `LLMEngine` / `LLM` to build on:

- `engine.config`: `ModelConfig` (conf/model yaml schema; `load_model_config(name_or_dir_or_gguf,
  dtype=None)`, `ModelConfig.from_hf_config(...)`, `.to_hf_config()`, `.eos_token_id`), and
  `CacheConfig(block_size=16, gpu_memory_utilization=0.9, swap_space=4.0 GiB, num_gpu_blocks=None)`.
- `engine.model_runner.ModelRunner(model_config, cache_config, *, max_num_batched_tokens,
  max_num_seqs, max_model_len, device="cpu", dtype=None, enforce_eager=False, seed=0,
  attention_backend="auto", compile_model=None)`:
  - builds the model (weights per `model_config.weights`; `seed` seeds dummy weights), sizes and
    allocates the KV cache, captures decode CUDA graphs (GPU, unless `enforce_eager`; buckets in
    `.graphs.sizes`). `dtype=None`: the model config's dtype on CUDA, float32 on CPU.
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
- `engine.sampler`: `Sampler`, `SampleResult`. `engine.kv_cache`: `KVCache` (per-layer
  `k_caches`/`v_caches` on the device, `cpu_k_caches`/`cpu_v_caches` swap pool, `apply(...)`).
- `engine.weights`: `build_model`, `load_hf_state_dict`, `to_hf_state_dict` (our weights under
  transformers' names: load them into `AutoModelForCausalLM.from_config(cfg.to_hf_config())`).
- `engine.input_batch`: SchedulerOutput -> flattened varlen tensors (prefill part, then decode part).
"""
