"""CUDA graphs of the decode-only forward, one per bucketed batch size (1, 2, 4, 8, 16, 32, ...,
max_num_seqs), captured largest first into one shared memory pool.

Each graph reads static input buffers; a decode batch of B sequences runs the smallest captured
size >= B, its extra rows padded inert (slot -1: no KV write; context length 0: zero output).
Block tables are captured at the full width `ceil(max_model_len / block_size)`, so the attention
kernel's launch shape never depends on the batch's contents.
"""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.input_batch import HostBatch
from engine.models.llama import LlamaForCausalLM


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.model = model
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], num_prefill_tokens=0,
                                 decode_block_tables=self.block_tables[:bs],
                                 decode_context_lens=self.context_lens[:bs])

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))

    @torch.no_grad()
    def _capture_all(self) -> None:
        pool = None
        for bs in reversed(self.sizes):
            self._forward(bs)  # warm-up outside the capture: Triton compiles here
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def bucket(self, num_seqs: int) -> int | None:
        """The captured batch size to run `num_seqs` decodes in, or None if too many."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def run(self, host: HostBatch) -> torch.Tensor:
        """`host`: a decode-only batch already padded to a captured size -> hidden [bs, hidden]."""
        bs = len(host.input_ids)
        width = host.decode_block_tables.shape[1]
        self.input_ids[:bs].copy_(torch.from_numpy(host.input_ids))
        self.positions[:bs].copy_(torch.from_numpy(host.positions))
        self.slot_mapping[:bs].copy_(torch.from_numpy(host.slot_mapping))
        self.context_lens[:bs].copy_(torch.from_numpy(host.decode_context_lens))
        self.block_tables[:bs, :width].copy_(torch.from_numpy(host.decode_block_tables))
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.outputs[bs]
