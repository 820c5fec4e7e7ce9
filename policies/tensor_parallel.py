"""How a model's dimensions split over `size` tensor-parallel ranks (Megatron-style, as vLLM does):
one rule for the engine's shards (engine/distributed/sharding.py) and the simulator's per-GPU
costs (sim/latency/tensor_parallel.py).

q heads and the MLP's intermediate size split evenly; KV heads split evenly when there are at least
as many as ranks, else each is replicated on `size / num_kv_heads` ranks (each rank holds one). A
size that does not divide is refused, naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass

from policies.request import is_int


@dataclass(slots=True, frozen=True)
class TPSplit:
    num_heads: int  # q heads per rank
    num_kv_heads: int  # KV heads per rank (1 when replicated)
    intermediate_size: int  # MLP columns per rank
    vocab_size: int  # embedding / LM-head rows per rank, ceil(vocab / size) (the last rank padded)


def check_tensor_parallel_size(size: object, field: str = "tensor_parallel_size") -> int:
    """`tensor_parallel_size`: an integer >= 1, or ValueError naming `field` (its place in the
    caller's config)."""
    if not is_int(size) or size < 1:
        raise ValueError(f"{field}={size!r} is invalid: must be an integer >= 1")
    return size


def tp_split(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, size: int,
             model: str = "model") -> TPSplit:
    check_tensor_parallel_size(size)
    if num_heads % size:
        raise ValueError(f"num_attention_heads={num_heads} of model {model!r} is not divisible by "
                         f"tensor_parallel_size={size}")
    if num_kv_heads >= size and num_kv_heads % size:
        raise ValueError(f"num_key_value_heads={num_kv_heads} of model {model!r} is not divisible by "
                         f"tensor_parallel_size={size}")
    if num_kv_heads < size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} is not a multiple of num_key_value_heads={num_kv_heads} "
                         f"of model {model!r} (fewer KV heads than ranks are replicated, evenly)")
    if intermediate_size % size:
        raise ValueError(f"intermediate_size={intermediate_size} of model {model!r} is not divisible by "
                         f"tensor_parallel_size={size}")
    return TPSplit(num_heads // size, max(1, num_kv_heads // size), intermediate_size // size,
                   -(-vocab_size // size))
