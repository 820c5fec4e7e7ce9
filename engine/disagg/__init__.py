"""Prefill/decode disaggregation on the engine: KV blocks moved between engine processes."""
