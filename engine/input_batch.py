"""Turns the scheduled sequences of a `SchedulerOutput` into one flattened varlen batch.

Sequences computing more than one token form the prefill part (first), sequences computing one
token (decodes, and any 1-token chunk) the decode part (after it). For each sequence the tokens
are positions `[num_computed_tokens, num_computed_tokens + num_new_tokens)` of `seq.token_ids`;
position p is written to slot `block_table[p // block_size] * block_size + p % block_size`.
Host arrays are built with numpy, then copied to the device in one pinned, non-blocking copy each.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from policies.outputs import ScheduledSeq


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [R] int64: batch row of the last token of each sampled sequence
    sampled: list[ScheduledSeq]  # the R sequences that sample, in `sample_rows` order
    num_tokens: int  # T (including decode padding rows)
    num_decode_seqs: int  # real decode rows (padding excluded)

    @property
    def decode_only(self) -> bool:
        return self.meta.num_prefill_tokens == 0


@dataclass(slots=True)
class HostBatch:
    """The same batch as numpy arrays, before the device copy (CUDA graphs copy these into static
    buffers)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    num_prefill_tokens: int
    prefill_block_tables: np.ndarray
    prefill_cu_seqlens_q: np.ndarray
    prefill_context_lens: np.ndarray
    decode_block_tables: np.ndarray
    decode_context_lens: np.ndarray
    sample_rows: np.ndarray
    sampled: list[ScheduledSeq]
    num_decode_seqs: int


def _block_table_array(seqs: list[ScheduledSeq], width: int, rows: int | None = None) -> np.ndarray:
    table = np.zeros((len(seqs) if rows is None else rows, width), dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, :len(s.seq.block_table)] = s.seq.block_table
    return table


def _check(s: ScheduledSeq, block_size: int) -> None:
    seq, start = s.seq, s.seq.num_computed_tokens
    end = start + s.num_new_tokens
    if s.num_new_tokens < 1 or end > seq.num_tokens:
        raise ValueError(f"seq {seq.seq_id}: num_new_tokens={s.num_new_tokens} is invalid with "
                         f"{start} computed of {seq.num_tokens} tokens")
    if len(seq.block_table) * block_size < end:
        raise ValueError(f"seq {seq.seq_id}: block_table holds {len(seq.block_table)} blocks of "
                         f"{block_size}, too few for {end} tokens")
    if s.num_samples > 0 and end != seq.num_tokens:
        raise ValueError(f"seq {seq.seq_id}: num_samples={s.num_samples} but the step ends at "
                         f"token {end} of {seq.num_tokens} (sampling needs the last token)")


def build_host_batch(scheduled: list[ScheduledSeq], block_size: int,
                     pad_decode_to: int | None = None) -> HostBatch:
    """`pad_decode_to`: pad the decode part with inert rows (no KV write, empty context) to this
    many rows, for a captured CUDA graph of that batch size."""
    prefills = [s for s in scheduled if s.num_new_tokens > 1]
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    for s in scheduled:
        _check(s, block_size)
    sampled = [s for s in prefills if s.num_samples > 0] + [s for s in decodes if s.num_samples > 0]
    # Prefill part: numpy per sequence (few sequences, many tokens each).
    pre_ids, pre_pos, pre_slots, cu, pre_ctx, sample_rows = [], [], [], [0], [], []
    for s in prefills:
        start = s.seq.num_computed_tokens
        end = start + s.num_new_tokens
        p = np.arange(start, end, dtype=np.int64)
        table = np.asarray(s.seq.block_table, dtype=np.int64)
        pre_ids.append(np.asarray(s.seq.token_ids[start:end], dtype=np.int64))
        pre_pos.append(p)
        pre_slots.append(table[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + s.num_new_tokens)
        pre_ctx.append(end)
        if s.num_samples > 0:
            sample_rows.append(cu[-1] - 1)
    num_prefill_tokens = cu[-1]
    # Decode part: plain Python ints per sequence (many sequences, one token each), padded.
    pad = 0 if pad_decode_to is None else pad_decode_to - len(decodes)
    if pad < 0:
        raise ValueError(f"pad_decode_to={pad_decode_to} is smaller than the {len(decodes)} decode rows")
    dec_pos = [s.seq.num_computed_tokens for s in decodes]
    dec_ids = [s.seq.token_ids[p] for s, p in zip(decodes, dec_pos)]
    dec_slots = [s.seq.block_table[p // block_size] * block_size + p % block_size
                 for s, p in zip(decodes, dec_pos)]
    dec_ctx = [p + 1 for p in dec_pos] + [0] * pad
    sample_rows += [num_prefill_tokens + i for i, s in enumerate(decodes) if s.num_samples > 0]
    width = max([len(s.seq.block_table) for s in scheduled] + [1])
    return HostBatch(
        input_ids=np.concatenate(pre_ids + [np.asarray(dec_ids + [0] * pad, dtype=np.int64)]),
        positions=np.concatenate(pre_pos + [np.asarray(dec_pos + [0] * pad, dtype=np.int64)]),
        slot_mapping=np.concatenate(pre_slots + [np.asarray(dec_slots + [-1] * pad, dtype=np.int64)]),
        num_prefill_tokens=num_prefill_tokens,
        prefill_block_tables=_block_table_array(prefills, width),
        prefill_cu_seqlens_q=np.asarray(cu, dtype=np.int32),
        prefill_context_lens=np.asarray(pre_ctx, dtype=np.int32),
        decode_block_tables=_block_table_array(decodes, width, len(decodes) + pad),
        decode_context_lens=np.asarray(dec_ctx, dtype=np.int32),
        sample_rows=np.asarray(sample_rows, dtype=np.int64),
        sampled=sampled, num_decode_seqs=len(decodes))


def to_device(host: HostBatch, device: torch.device) -> ModelInput:
    pin = device.type == "cuda"

    def put(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)

    has_prefill = host.num_prefill_tokens > 0
    has_decode = len(host.decode_context_lens) > 0
    meta = AttentionMetadata(
        slot_mapping=put(host.slot_mapping), num_prefill_tokens=host.num_prefill_tokens,
        prefill_block_tables=put(host.prefill_block_tables) if has_prefill else None,
        prefill_cu_seqlens_q=put(host.prefill_cu_seqlens_q) if has_prefill else None,
        prefill_context_lens=put(host.prefill_context_lens) if has_prefill else None,
        prefill_max_seqlen_q=int(np.diff(host.prefill_cu_seqlens_q).max()) if has_prefill else 0,
        decode_block_tables=put(host.decode_block_tables) if has_decode else None,
        decode_context_lens=put(host.decode_context_lens) if has_decode else None)
    return ModelInput(input_ids=put(host.input_ids), positions=put(host.positions), meta=meta,
                      sample_rows=put(host.sample_rows), sampled=host.sampled,
                      num_tokens=len(host.input_ids), num_decode_seqs=host.num_decode_seqs)


def build_model_input(scheduled: list[ScheduledSeq], block_size: int, device: torch.device,
                      pad_decode_to: int | None = None) -> ModelInput:
    return to_device(build_host_batch(scheduled, block_size, pad_decode_to), device)
