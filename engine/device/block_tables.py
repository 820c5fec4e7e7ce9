"""Block tables of the decode rows, kept between steps as numpy rows.

A decode sequence's block table changes rarely (a new block every `block_size` steps, a
copy-on-write, a swap): its row is rewritten only when the list differs from the copy kept with
it (a C-speed list comparison), and a step's rows are then one gather. Rows of sequences absent
from a step are recycled, so at most two steps' sequences hold rows at once.
"""
from __future__ import annotations

import numpy as np

from policies.sequence import Sequence


class BlockTableRows:
    def __init__(self, max_seqs: int, width: int) -> None:
        self.max_seqs = max_seqs
        self.width = width
        self.rows = np.zeros((2 * max_seqs, width), dtype=np.int32)
        self._free = list(range(2 * max_seqs))
        self._entries: dict[int, list] = {}  # seq_id -> [row, copy of the block table written there]

    def gather(self, seqs: list[Sequence], out: np.ndarray) -> None:
        """out[i, :len(table)] = seqs[i].block_table, zeros after it, for every i. `out` is
        [len(seqs), W] int32; sequences beyond max_seqs or tables wider than W are written directly."""
        width = out.shape[1]
        if len(seqs) > self.max_seqs or width > self.width:
            for i, seq in enumerate(seqs):
                out[i, :len(seq.block_table)] = seq.block_table
                out[i, len(seq.block_table):] = 0
            return
        try:
            index = self._rows_of(seqs, width)
        except Exception:
            self._entries, self._free = {}, list(range(len(self.rows)))  # forget every row, stay usable
            raise
        np.take(self.rows[:, :width], index, axis=0, out=out)

    def _rows_of(self, seqs: list[Sequence], width: int) -> list[int]:
        """Row of each sequence, rewritten where its table changed; frees the rows of the others."""
        old, new, free, rows = self._entries, {}, self._free, self.rows
        index = [0] * len(seqs)
        for i, seq in enumerate(seqs):
            table = seq.block_table
            entry = old.pop(seq.seq_id, None)
            if entry is None:
                if seq.seq_id in new:
                    raise ValueError(f"seq {seq.seq_id} is scheduled twice in one step")
                entry = [free.pop(), None]
            if entry[1] != table:
                if len(table) > width:
                    raise ValueError(f"seq {seq.seq_id}: block_table of {len(table)} blocks is wider than "
                                     f"the batch's {width} columns")
                row = rows[entry[0]]
                row[:len(table)] = table
                row[len(table):] = 0
                entry[1] = table.copy()
            new[seq.seq_id] = entry
            index[i] = entry[0]
        free.extend(entry[0] for entry in old.values())
        self._entries = new
        return index
