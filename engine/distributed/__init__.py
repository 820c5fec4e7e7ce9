"""Tensor parallelism: rank 0 (the engine's process) runs the scheduler and broadcasts each step
to workers 1..N-1, each holding a Megatron-style shard of the model and its own KV cache
(docs/parallelism.md)."""
