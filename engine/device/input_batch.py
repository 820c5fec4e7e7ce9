"""Turns the scheduled sequences of a `SchedulerOutput` into one flattened varlen batch.

Layout (eager steps and CUDA graphs alike): the decode rows first (sequences computing one token:
decodes, and any 1-token chunk), then the prefill sequences' rows (more than one token each), then
padding rows up to the shape's `num_tokens` (token 0, position 0, slot -1: no KV write). For each
sequence the tokens are positions `[num_computed_tokens, num_computed_tokens + num_new_tokens)` of
`seq.token_ids`; position p is written to slot `block_table[p // block_size] * block_size +
p % block_size`. Sampled rows (the last row of each sequence with num_samples > 0) are listed
decode rows first, in scheduled order.

`BatchBuilder.plan` sorts and checks a step (no buffer written); `fill` writes it, padded to a
shape, into the pinned buffers of `engine.device.batch_layout` with numpy (decode rows vectorised, block
tables kept between steps by `BlockTableRows`); `upload` makes it one host-to-device copy and
returns the `ModelInput` views.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter, getitem, itemgetter

import numpy as np
import torch

from engine.device.attention import AttentionMetadata
from engine.device.batch_layout import BatchShape, InputBuffers
from engine.device.block_tables import BlockTableRows
from kernels.prefill import tile_map
from policies.block_table_width import table_width
from policies.outputs import ScheduledSeq


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [R] int64: batch row of the last token of each sampled sequence
    temperatures: torch.Tensor  # [R] float32 (read by the fast sampling path only)


@dataclass(slots=True)
class StepPlan:
    """One step sorted into the batch layout and checked, before any buffer is written."""

    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    decode_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    decode_sample_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sampled: list[ScheduledSeq] = field(default_factory=list)  # decode rows first, then prefills
    num_tokens: int = 0
    width: int = 1  # the longest block table (at least 1 column)

    @property
    def decode_only(self) -> bool:
        return not self.prefills

    @property
    def prefill_lens(self) -> list[int]:
        return [s.num_new_tokens for s in self.prefills]

    def shape(self) -> BatchShape:
        """The shape of an eager step: its exact rows, its block tables `table_width` columns wide."""
        return BatchShape(self.num_tokens, len(self.decodes), len(self.prefills), len(self.sampled),
                          table_width(self.width))

    def check_within(self, max_len: int) -> None:
        """ValueError naming the first sequence whose rows reach past token `max_len` (positions
        from max_len on have no rotary row and no block-table column: on a GPU the step would end
        in a device-side assert)."""
        for s in [*self.decodes, *self.prefills]:
            end = s.seq.num_computed_tokens + s.num_new_tokens
            if end > max_len:
                raise ValueError(f"seq {s.seq.seq_id}: the step computes its tokens up to {end}, past "
                                 f"max_model_len={max_len} (the scheduler never schedules a sequence past "
                                 "it; a step built by hand must stay within it)")


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


_SEQ, _NUM_NEW, _NUM_SAMPLES = itemgetter(0), itemgetter(1), itemgetter(2)  # ScheduledSeq fields
_COMPUTED, _TOKENS, _TABLE = attrgetter("num_computed_tokens"), attrgetter("token_ids"), attrgetter("block_table")


def plan_step(scheduled: list[ScheduledSeq], block_size: int) -> StepPlan:
    num_new = list(map(_NUM_NEW, scheduled))
    if num_new.count(1) == len(num_new):
        decodes, prefills = scheduled, []
    else:
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens != 1]
    for s in prefills:
        _check(s, block_size)
    seqs = list(map(_SEQ, decodes))
    positions = np.fromiter(map(_COMPUTED, seqs), dtype=np.int64, count=len(seqs))
    num_blocks = np.fromiter(map(len, map(_TABLE, seqs)), dtype=np.int64, count=len(seqs))
    samples = np.fromiter(map(_NUM_SAMPLES, decodes), dtype=np.int64, count=len(seqs))
    if decodes:  # the checks of `_check`, vectorised; the first failing row raises its message
        ends = positions + 1
        num_tokens = np.fromiter(map(len, map(_TOKENS, seqs)), dtype=np.int64, count=len(seqs))
        bad = (ends > num_tokens) | (num_blocks * block_size < ends) | ((samples > 0) & (ends != num_tokens))
        if bad.any():
            _check(decodes[int(bad.argmax())], block_size)
    sample_rows = np.flatnonzero(samples)
    sampled = [decodes[i] for i in sample_rows.tolist()] + [s for s in prefills if s.num_samples > 0]
    width = max([int(num_blocks.max(initial=1))] + [len(s.seq.block_table) for s in prefills])
    return StepPlan(decodes, prefills, positions, sample_rows, sampled,
                    len(decodes) + sum(s.num_new_tokens for s in prefills), width)


class BatchBuilder:
    """Owns the step input buffers (sized by `capacity`) and the decode rows' block tables.
    `tokens_per_tile`: the prefill kernel's tokens per program, for shapes with a tile map."""

    def __init__(self, block_size: int, capacity: BatchShape, device: torch.device,
                 tokens_per_tile: int = 1, max_len: int | None = None) -> None:
        self.block_size = block_size
        self.max_len = max_len  # the longest sequence a step may hold (max_model_len); None: any
        self.device = device
        self.tokens_per_tile = tokens_per_tile
        self.buffers = InputBuffers(capacity, device)
        self.block_tables = BlockTableRows(capacity.num_decode_rows, capacity.width)
        self._views: dict[tuple[BatchShape, int], ModelInput] = {}

    def plan(self, scheduled: list[ScheduledSeq]) -> StepPlan:
        plan = plan_step(scheduled, self.block_size)
        # Only a block table reaching past max_len's last block can hold a row past it (the tables
        # cover every computed token): one comparison per step, the rows looked at only then.
        if self.max_len is not None and plan.width * self.block_size > self.max_len:
            plan.check_within(self.max_len)
        return plan

    def write(self, plan: StepPlan, shape: BatchShape, temperatures: list[float] | None = None) -> InputBuffers:
        """Fill `plan` padded to `shape` (which it must fit) and start its copy to the device."""
        buffers = self.buffers if shape.fits_in(self.buffers.capacity) else InputBuffers(shape, self.device)
        self.fill(buffers.host_views(shape), plan, temperatures)
        buffers.upload(shape)
        return buffers

    def prepare(self, plan: StepPlan, shape: BatchShape, temperatures: list[float] | None = None,
                cache: bool = True) -> ModelInput:
        """`write`, then the device views (kept per shape and max_seqlen_q unless `cache=False`)."""
        buffers = self.write(plan, shape, temperatures)
        max_q = max(plan.prefill_lens, default=0)
        if buffers is not self.buffers or not cache:
            return _model_input(buffers.device_views(shape), shape, max_q)
        return self.views(shape, max_q)

    def views(self, shape: BatchShape, max_seqlen_q: int) -> ModelInput:
        """The device views of `shape`'s fields in the buffers, kept per (shape, max_seqlen_q)."""
        key = (shape, max_seqlen_q)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 256:
                self._views.clear()
            views = self._views[key] = _model_input(self.buffers.device_views(shape), shape, max_seqlen_q)
        return views

    def fill(self, v: dict[str, np.ndarray], plan: StepPlan, temperatures: list[float] | None) -> None:
        """Write `plan` into the host views `v` of a shape it fits, padding every field."""
        bs, d = self.block_size, len(plan.decodes)
        ids, pos, slots = v["input_ids"], v["positions"], v["slot_mapping"]
        if d:
            p = plan.decode_positions
            seqs = list(map(_SEQ, plan.decodes))
            ids[:d] = list(map(getitem, map(_TOKENS, seqs), p.tolist()))
            pos[:d] = p
            tables = v["decode_block_tables"][:d]
            self.block_tables.gather(seqs, tables)
            slots[:d] = tables[np.arange(d), p // bs].astype(np.int64) * bs + p % bs
        v["decode_context_lens"][:d] = plan.decode_positions + 1
        v["decode_context_lens"][d:] = 0
        # Longest first: the per-head and TMA decode kernels launch the longest sequences' programs
        # first once their grid exceeds one wave (kernels/decode_splits.py: launch_order)
        v["decode_order"][:] = np.argsort(-v["decode_context_lens"], kind="stable")
        cu, ctx, tables = v["prefill_cu_seqlens_q"], v["prefill_context_lens"], v["prefill_block_tables"]
        row = cu[0] = d
        for i, s in enumerate(plan.prefills):
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            p = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(s.seq.block_table, dtype=np.int64)
            ids[row:row + n] = s.seq.token_ids[start:start + n]
            pos[row:row + n] = p
            slots[row:row + n] = table[p // bs] * bs + p % bs
            tables[i, :len(table)] = table
            tables[i, len(table):] = 0
            ctx[i] = start + n
            row = cu[i + 1] = row + n
        s_real = len(plan.prefills)
        cu[s_real + 1:] = row
        ctx[s_real:] = 0
        ids[row:], pos[row:], slots[row:] = 0, 0, -1
        if len(v["prefill_tiles"]):
            tile_map(np.diff(cu), self.tokens_per_tile, v["prefill_tiles"])
        r, r_dec = len(plan.sampled), len(plan.decode_sample_rows)
        v["sample_rows"][:r_dec] = plan.decode_sample_rows
        v["sample_rows"][r_dec:r] = [int(cu[i + 1]) - 1 for i, s in enumerate(plan.prefills) if s.num_samples > 0]
        v["sample_rows"][r:] = 0
        v["temperatures"][:r] = 0.0 if temperatures is None else temperatures
        v["temperatures"][r:] = 0.0


def _model_input(t: dict[str, torch.Tensor], shape: BatchShape, max_seqlen_q: int) -> ModelInput:
    d, has_prefill = shape.num_decode_rows, shape.num_prefill_seqs > 0
    meta = AttentionMetadata(
        slot_mapping=t["slot_mapping"], num_decode_rows=d,
        decode_block_tables=t["decode_block_tables"] if d else None,
        decode_context_lens=t["decode_context_lens"] if d else None,
        decode_order=t["decode_order"] if d else None,
        prefill_block_tables=t["prefill_block_tables"] if has_prefill else None,
        prefill_cu_seqlens_q=t["prefill_cu_seqlens_q"] if has_prefill else None,
        prefill_context_lens=t["prefill_context_lens"] if has_prefill else None,
        prefill_max_seqlen_q=max_seqlen_q,
        prefill_tiles=t["prefill_tiles"] if shape.num_tiles else None)
    return ModelInput(t["input_ids"], t["positions"], meta, t["sample_rows"], t["temperatures"])


def build_model_input(scheduled: list[ScheduledSeq], block_size: int, device: torch.device) -> ModelInput:
    """One eager step's inputs with throwaway buffers (tests, one-off forwards)."""
    plan = plan_step(scheduled, block_size)
    shape = plan.shape()
    return BatchBuilder(block_size, shape, device).prepare(plan, shape)
