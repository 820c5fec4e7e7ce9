"""The offline engine: `LLMEngine` (requests in, outputs out, one `step()` at a time), `LLM`,
outputs, text (tokenizer, incremental detokenization)."""
