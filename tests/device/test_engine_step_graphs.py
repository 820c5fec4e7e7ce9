"""The CUDA-graph step shapes, checked on CPU: `StepGraphs(capture=False)` runs the padded static
shapes (decode buckets; token buckets with idle decode rows and a prefill tile map) eagerly through
the interpreted Triton kernels, and must give the tokens and logprobs of unpadded eager steps."""
import numpy as np
import pytest
import torch

from engine.config import CacheConfig
from engine.device.cuda_graph import StepGraphs, graph_batch_sizes, graph_token_sizes
from engine.device.model_runner import ModelRunner
from engine.model_loader import load_model_config
from kernels import reference
from kernels.decode_packed import PackedDecodeConfig
from kernels.decode_tma import TmaDecodeConfig
from kernels.inputs import random_paged_problem
from kernels.prefill import PrefillConfig, max_tiles, paged_prefill_attention, tile_map, tokens_per_tile
from policies.request import SamplingParams
from tests.engine_model_helpers import BlockAllocator, make_seqs, random_prompts, step

BLOCK = 4


def test_bucket_sizes():
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_token_sizes(16384) == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
                                        8192, 12288, 16384]
    assert graph_token_sizes(600) == [16, 32, 64, 128, 256, 512, 600]
    assert graph_token_sizes(10) == [10]


def test_tile_map_grid_equals_the_eager_grid():
    q_lens, context_lens = [5, 40, 2, 17], [9, 40, 30, 50]
    config = PrefillConfig(block_m=32, block_n=16)
    prob = random_paged_problem(context_lens, q_lens, 4, 2, 16, BLOCK, torch.float32, seed=3)
    tokens = tokens_per_tile(4, 2, config)
    tiles = np.zeros((max_tiles(sum(q_lens), len(q_lens), tokens) + 3, 2), dtype=np.int32)  # spare rows idle
    assert tile_map(np.array(q_lens), tokens, tiles) == sum(-(-q // tokens) for q in q_lens)
    out = torch.full_like(prob.q, float("nan"))
    paged_prefill_attention(*prob.prefill_args(), config=config, out=out, tiles=torch.from_numpy(tiles))
    ref = reference.paged_prefill_attention(*prob.to(torch.float64).prefill_args())
    assert not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="tile map of 2 rows"):
        tile_map(np.array(q_lens), tokens, tiles[:2])


def make_runner(padded: bool, decode_kernel: str = "per-head") -> ModelRunner:
    cfg = load_model_config("tiny-qwen3")
    runner = ModelRunner(cfg, CacheConfig(block_size=BLOCK, num_gpu_blocks=96, swap_space=0.001),
                         max_num_batched_tokens=48, max_num_seqs=6, max_model_len=64, device="cpu",
                         attention_backend="triton", decode_kernel=decode_kernel)
    if padded:
        runner.graphs = StepGraphs(runner.model, runner.batch, max_num_seqs=6, max_num_batched_tokens=48,
                                   width=runner.batch.buffers.capacity.width, capture=False)
    return runner


PROMPTS = random_prompts([11, 3, 26, 7, 2], 256, seed=4)
PARAMS = SamplingParams(temperature=0, logprobs=2, max_tokens=8)


@torch.no_grad()
def run_steps(padded: bool, decode_kernel: str) -> list[dict]:
    """9 steps of chunked prompts of different lengths: each step's tokens and logprobs by sequence."""
    runner = make_runner(padded, decode_kernel)
    config = getattr(runner.ops.paged_decode_attention, "keywords", {}).get("config")
    assert isinstance(config, PackedDecodeConfig) == (padded and decode_kernel == "packed")
    assert isinstance(config, TmaDecodeConfig) == (padded and decode_kernel == "tma")
    seqs, alloc = make_seqs(PROMPTS, PARAMS), BlockAllocator(BLOCK, runner.num_gpu_blocks)
    steps = []
    for _ in range(9):
        out = step(runner, alloc, seqs, chunk=8)
        steps.append({k: (r.token_ids, r.logprobs) for k, r in out.items()})
    if padded:
        assert runner.graphs.num_replays == 9
    return steps


@pytest.fixture(scope="module")
def eager_steps() -> list[dict]:
    """The unpadded run every decode kernel's padded run is compared with (the same for each)."""
    return run_steps(padded=False, decode_kernel="per-head")


@pytest.mark.parametrize("decode_kernel", ["per-head", "packed", "tma"])
def test_padded_step_shapes_equal_eager_steps(decode_kernel, eager_steps):
    """Chunked prompts of different lengths: steps that prefill only, mix prefill chunks with decodes,
    and decode only (5 of 6 rows: padded), each in its bucket, against the same steps unpadded (the
    unpadded run with the per-head decode kernel, the padded one with `decode_kernel`)."""
    results = [eager_steps, run_steps(padded=True, decode_kernel=decode_kernel)]
    for eager, padded in zip(*results):
        assert eager.keys() == padded.keys()
        for seq_id, (tokens, logprobs) in eager.items():
            assert padded[seq_id][0] == tokens
            for want, got in zip(logprobs, padded[seq_id][1]):
                assert want.keys() == got.keys()
                assert all(abs(want[t] - got[t]) < 1e-4 for t in want)
