"""CUDA graphs of whole steps (forward and the logits of the sampled rows), captured largest
first into one shared memory pool, on the views of the step input buffers (`engine.device.batch_layout`).

Two families of buckets:
- decode-only steps of B sequences run the graph of the smallest batch size >= B (1, 2, 4, 8, 16,
  32, ..., max_num_seqs); rows past B are inert (slot -1: no KV write; context 0: zero output);
- steps with prefill tokens (prefill-only or mixed) of T tokens run the graph of the smallest
  token count >= T (16, 32, 64, ... with 1.5x steps from 512, up to `MAX_GRAPH_TOKENS`). Its
  decode kernel covers min(T, max_num_seqs) rows (those past the step's decode rows are idle),
  and its prefill kernel a tile map with room for any batch of that many tokens.
Block tables are captured at the full width (`ceil(max_model_len / block_size)`, rounded up to a
multiple of 16: `table_width`), so no launch shape depends on the batch's contents. Larger steps run eagerly (the GPU is the bottleneck there), as do
steps of `eager_from` tokens or more (the sequence-parallel steps, engine/models/sequence_parallel.py:
no token bucket reaches that size, and captures run the all-reduce path, `sequence_parallel=False`).
Logits go to one static [max rows, width] buffer in the model's dtype (the model's logit columns:
the whole vocabulary, or one tensor-parallel rank's share); sampling runs after the replay.
"""
from __future__ import annotations

import torch

from engine.device.batch_layout import BatchShape
from engine.device.input_batch import BatchBuilder, ModelInput, StepPlan
from engine.models.llama import LlamaForCausalLM
from kernels.prefill import max_tiles

MAX_GRAPH_TOKENS = 16384


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


def graph_token_sizes(max_num_batched_tokens: int, eager_from: int = 0) -> list[int]:
    """16, 32, ..., 512, then 768, 1024, 1536, 2048, ... (powers of 2 and 1.5x them), up to the
    batch limit (capped at MAX_GRAPH_TOKENS, and below `eager_from` if set); padding stays under
    half of the bucket."""
    top = min(max_num_batched_tokens, MAX_GRAPH_TOKENS)
    if eager_from > 0:
        top = min(top, eager_from - 1)
        if top < 1:
            return []
    sizes, power = [], 16
    while power < top:
        sizes += [power] + ([power * 3 // 2] if power >= 512 else [])
        power *= 2
    return [s for s in sizes if s < top] + [top]


class StepGraphs:
    """`capture=False` keeps the same static shapes and buffers but runs them eagerly (the CPU tests
    check the padded layouts this way). `eager_from`: steps of this many tokens or more get no
    graph (the sequence-parallel steps; 0: no such bound)."""

    def __init__(self, model: LlamaForCausalLM, builder: BatchBuilder, *, max_num_seqs: int,
                 max_num_batched_tokens: int, width: int, capture: bool = True, eager_from: int = 0) -> None:
        self.model = model
        self.builder = builder
        self.width = width
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.token_sizes = graph_token_sizes(max_num_batched_tokens, eager_from)
        self.decode_shapes = {b: BatchShape(b, b, 0, b, width) for b in self.sizes}
        self.mixed_shapes = {t: self._mixed_shape(t, max_num_seqs) for t in self.token_sizes}
        too_large = [s for s in self.shapes() if not s.fits_in(builder.buffers.capacity)]
        if too_large:
            raise ValueError(f"graph shape {too_large[0]} is invalid: larger than the input buffers' "
                             f"{builder.buffers.capacity}")
        rows = max(s.num_sample_rows for s in (*self.decode_shapes.values(), *self.mixed_shapes.values()))
        weight = next(model.parameters())
        self.logits = torch.empty(rows, model.vocab_columns[1], dtype=weight.dtype, device=weight.device)
        self.inputs: dict[BatchShape, ModelInput] = {}
        self.graphs: dict[BatchShape, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self._capture = capture
        self._capture_all()

    def _mixed_shape(self, num_tokens: int, max_num_seqs: int) -> BatchShape:
        seqs = min(num_tokens // 2, max_num_seqs)  # a prefill sequence computes >= 2 tokens
        rows = min(num_tokens, max_num_seqs)
        return BatchShape(num_tokens, rows, seqs, rows, self.width,
                          max_tiles(num_tokens, seqs, self.builder.tokens_per_tile))

    def shapes(self) -> list[BatchShape]:
        return [*self.decode_shapes.values(), *self.mixed_shapes.values()]

    @torch.no_grad()
    def _capture_all(self) -> None:
        pool = None
        for shape in sorted(self.shapes(), key=lambda s: (s.num_tokens, s.num_tiles), reverse=True):
            self.inputs[shape] = self.builder.prepare(StepPlan(), shape, cache=False)  # every row idle
            if not self._capture:
                continue
            self._forward(shape)  # warm-up outside the capture: Triton and torch.compile compile here
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(shape)
            pool = graph.pool()
            self.graphs[shape] = graph
        if self._capture:
            torch.cuda.synchronize()

    def _forward(self, shape: BatchShape) -> None:
        inputs = self.inputs[shape]
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, sequence_parallel=False)
        self.model.compute_local_logits(hidden[inputs.sample_rows], out=self.logits[:shape.num_sample_rows])

    def shape_for(self, plan: StepPlan) -> BatchShape | None:
        """The captured shape to run `plan` in, or None (too large: run it eagerly)."""
        if plan.width > self.width:
            return None
        if plan.decode_only:
            size = next((b for b in self.sizes if b >= len(plan.decodes)), None)
            return None if size is None else self.decode_shapes[size]
        size = next((t for t in self.token_sizes if t >= plan.num_tokens), None)
        if size is None:
            return None
        shape = self.mixed_shapes[size]
        tokens = self.builder.tokens_per_tile
        tiles = sum(-(-n // tokens) for n in plan.prefill_lens)
        return shape if plan.shape().fits_in(shape) and tiles <= shape.num_tiles else None

    def release(self) -> None:
        """Free the captured graphs once their last replay is done. Tensor parallelism: before the
        communicator their all-reduces use is ended (a graph holds on to the communicator's work)."""
        if self.graphs:
            torch.cuda.synchronize(self.logits.device)
            for graph in self.graphs.values():
                graph.reset()
            self.graphs.clear()

    def run(self, shape: BatchShape) -> torch.Tensor:
        """Replay `shape`'s graph on the inputs already uploaded -> logits [shape rows, width]."""
        if self._capture:
            self.graphs[shape].replay()
        else:
            self._forward(shape)
        self.num_replays += 1
        return self.logits[:shape.num_sample_rows]
