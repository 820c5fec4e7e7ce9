"""How many block-table columns a step's inputs carry: one rule for the engine (its step inputs,
CUDA-graph captures and the decode kernels' split-KV count, which follows the table's width) and
the simulator's price of those kernels (sim/latency/decode_attention_pricing.py).

Triton specializes an integer kernel argument on whether it is 1 or a multiple of 16, and the
attention kernels take the block tables' row stride and width as arguments. A width that followed
each step's longest table compiled new kernel variants whenever a step's width was not a multiple
of 16: eager steps of new sizes compiled them mid-run (on two H200s, the first sequence-parallel
run from empty caches spent ~5 s of a 14 s run compiling). Rounded up to a multiple of 16, every
shape passes the same specialization.
"""
from __future__ import annotations

WIDTH_ALIGN = 16  # Triton's integer specialization: divisible by 16


def table_width(blocks: int) -> int:
    """The columns of a step whose longest block table has `blocks` blocks: at least one block,
    rounded up to a multiple of WIDTH_ALIGN."""
    return -(-max(blocks, 1) // WIDTH_ALIGN) * WIDTH_ALIGN


def table_tokens(max_model_len: int, block_size: int) -> int:
    """The tokens a block-table row of the engine's full width covers: max_model_len's blocks at
    `table_width` columns (the decode kernels' split count follows it)."""
    return table_width(-(-max_model_len // block_size)) * block_size
