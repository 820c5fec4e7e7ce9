"""A step's seconds in the operator model (`OperatorModel`, sim/latency/operators.py, whose
docstring gives the sum and where each term's rows come from): the terms the model built at
construction, read at the rows the step runs (its CUDA graph's, padding included; an eager step's
own, or the sequence-parallel layer stack's), with each operator family's seconds booked where a
caller asks for a breakdown (experiments/lab/operator_breakdown.py).
"""
from __future__ import annotations

from sim.latency.base import BatchShape
from sim.latency.sequence_parallel_pricing import ELEMENTWISE
from sim.latency.token_padding import padded


def _book(parts: dict[str, float], s: BatchShape, seconds: dict[str, float | None]) -> None:
    """Adds each operator family's seconds of a step of shape `s` to `parts`: the families the
    step runs (a term the step has none of, or None, is not booked)."""
    runs = {"copy_blocks": s.num_copies, "lm head, sampler": s.num_samples, "all-gather": s.num_samples,
            "decode attention": s.num_decode_seqs, "prefill attention": s.num_prefill_tokens}
    for name, t in seconds.items():
        if t is not None and runs.get(name, True):
            parts[name] = parts.get(name, 0.0) + t


class OperatorStepPrice:
    """Mixed into `OperatorModel`: every method reads the terms the model built (its grids, graph
    sizes, collectives and the pricing of decode attention and sequence-parallel steps)."""

    def shape_time(self, s: BatchShape, parts: dict[str, float] | None = None) -> float:
        """Seconds of a step of shape `s`; with `parts`, each operator family's seconds are also
        added to it (experiments/lab/operator_breakdown.py). The terms are summed in one order
        whether or not they are booked, so a breakdown prices exactly what a run does."""
        tokens = s.num_prefill_tokens + s.num_decode_seqs
        if tokens == 0 and s.num_copies == 0:
            return 0.0
        host = self.launch_s + self.host_step_s
        copy = 0.0
        if s.num_copies:
            if self.copy is None:
                raise ValueError(f"operator profile {[str(p) for p in self.profile.paths]} lacks op copy_blocks: "
                                 "a step with copy-on-write copies needs it")
            copy = self.copy(s.num_copies * self.block_bytes)
        if tokens == 0:
            if parts is not None:
                _book(parts, s, {"launch, host": host, "copy_blocks": copy})
            return host + copy
        sizes = self.token_sizes if s.num_prefill_tokens else self.batch_sizes
        rows = padded(tokens, sizes)
        layers = None  # a sequence-parallel step's layer stack, by family
        if self.sequence_parallel is not None and self.sequence_parallel.takes(tokens, sizes):
            layers = self.sequence_parallel.parts(tokens)
        token_ops = self.token_curve(rows) if layers is None else sum(layers.values())
        head = decode = prefill = reduce = gather = norms = 0.0
        logit_rows = self.logit_rows(rows, s) if s.num_samples else 0
        if s.num_samples:
            head = self.lm_head(logit_rows) + self.sampler(s.num_samples)
        L = self.model.num_hidden_layers
        if s.num_decode_seqs:
            decode = L * self.decode_attention(s, rows)
        if s.num_prefill_tokens:
            chunks = s.prefill_chunks or ((s.num_prefill_tokens, s.prefill_context_tokens),)
            attn = self.prefill_floor + sum(self.prefill(q, c) - self.prefill_floor for q, c in chunks)
            prefill = L * max(attn, self.prefill_floor)
        if self.all_reduce is not None:
            if layers is None:
                reduce, norms = self.reduce_time(rows)
            if s.num_samples:
                gather = self.all_gather(s.num_samples * self.pair_bytes)
        if parts is not None:
            if layers is None:
                families = {name: curve(rows) for name, curve in self.token_families.items()}
                families[ELEMENTWISE] += norms
            else:
                families = layers
            _book(parts, s, {"launch, host": host, "copy_blocks": copy, **families, "lm head, sampler": head,
                             "decode attention": decode, "prefill attention": prefill,
                             "all-reduce": reduce if self.all_reduce is not None and layers is None else None,
                             "all-gather": gather if self.all_reduce is not None else None})
        return host + copy + token_ops + head + decode + prefill + reduce + gather + norms

    def reduce_time(self, rows: int) -> tuple[float, float]:
        """(all-reduces, norms not in the token curve) of a step of `rows` tokens: its 2 L + 1
        all-reduces, the fused boundaries' in one kernel with their add + RMSNorm where the engine
        fuses a message of this size, else beside them."""
        nbytes = rows * self.token_bytes
        one = self.all_reduce(nbytes)
        fused = self.fused_boundary(nbytes) if self.fused_boundary is not None else None
        if fused is None:
            return (2 * self.model.num_hidden_layers + 1) * one, self.fused_count * self.add_rms_norm(rows)
        return (2 * self.model.num_hidden_layers + 1 - self.fused_count) * one + self.fused_count * fused, 0.0

    def graph_rows(self, rows: int, s: BatchShape) -> int | None:
        """The sample and decode rows of the CUDA graph a step of `rows` tokens runs (a decode
        graph's batch size; a token graph's min(tokens, max_num_seqs), engine/device/cuda_graph.py),
        padding included; None for an eager step."""
        if s.num_prefill_tokens:
            if rows not in self.token_sizes or not self.batch_sizes:
                return None
            return min(rows, self.batch_sizes[-1])
        return rows if rows in self.batch_sizes else None

    def logit_rows(self, rows: int, s: BatchShape) -> int:
        """Rows the LM head computes: all of a graph's sample rows, an eager step's sampled rows."""
        return max(self.graph_rows(rows, s) or 0, s.num_samples)

    def decode_attention(self, s: BatchShape, rows: int) -> float:
        """One layer's decode attention of a step of `rows` tokens, launched at its graph's decode
        rows (`graph_rows`; an eager step's decodes)."""
        launch = (self.graph_rows(rows, s) or s.num_decode_seqs) if self.decode_pricing.splits_by_launch else 0
        return self.decode_pricing.time(s, launch)
