"""One-pass Gumbel-max sampling (kernels.sample, interpreted on the CPU) and its torch reference."""

import pytest
import torch

from kernels import reference
from kernels.sample import sample_gumbel, sample_gumbel_shard

IMPLS = {"triton": sample_gumbel, "reference": reference.sample_gumbel}


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_rows_are_argmax_with_first_index_ties(impl):
    logits = torch.randn(6, 3000)
    logits[2, [7, 2900]] = 50.0  # a tie: the lower index wins, as torch.argmax
    logits[4] = float("-inf")
    logits[4, 2999] = 0.0
    temps = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.5])
    out = IMPLS[impl](logits, temps, seed=3)
    greedy = [0, 1, 2, 4]
    assert out[greedy].tolist() == logits.argmax(-1)[greedy].tolist()
    assert out[2].item() == 7 and out[4].item() == 2999
    assert out.dtype == torch.int64 and ((out >= 0) & (out < 3000)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_tempered_rows_follow_softmax_over_temperature(impl):
    """400 draws from one 8-token distribution at T = 0.7: every frequency within 5 standard
    errors of softmax(logits / 0.7) (the seed is fixed, so this cannot flake)."""
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])
    rows = 400
    out = IMPLS[impl](base.repeat(rows, 1), torch.full((rows,), 0.7), seed=11)
    freq = torch.bincount(out, minlength=8).double() / rows
    p = torch.softmax(base.double() / 0.7, 0)
    assert freq[6] == 0  # -inf is never drawn
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / rows).sqrt() + 1e-3).all(), (freq, p)


def test_seed_fixes_the_draw_and_chunks_cover_the_vocab():
    """Same seed, same tokens; another seed, other tokens; a vocab over several chunks can be
    drawn anywhere (the winning chunk is found by the second kernel). A row's draw depends on its
    index, not on the rows after it: the repeat draws take the first 8 rows."""
    from kernels import sample

    logits = torch.zeros(16, 3 * 1024 + 5)
    logits[0, 3076] = 30.0  # row 0's winner sits alone in the last, 5-token chunk
    temps = torch.ones(16)
    old = sample.CHUNK, sample.BLOCK
    sample.CHUNK, sample.BLOCK = 1024, 256
    try:
        a = sample_gumbel(logits, temps, seed=1)
        b, c = (sample_gumbel(logits[:8], temps[:8], seed=s) for s in (1, 2))
    finally:
        sample.CHUNK, sample.BLOCK = old
    assert a[:8].tolist() == b.tolist() and a[:8].tolist() != c.tolist()
    assert a[0].item() == 3076
    assert set((a[1:] // 1024).tolist()) == {0, 1, 2}  # uniform logits: each full chunk wins somewhere


def test_rows_and_quarters_draw_independently():
    """Uniform logits over one 1024-token chunk (4 Philox quarters of 64 lanes per 256-token tile):
    64 rows draw 64 nearly all different tokens (rows sharing counters would draw alike) landing
    in every quarter; bf16 logits give the same draw as their float32 values (the first 16 rows:
    a row's draw does not depend on the rows after it)."""
    from kernels import sample

    logits = torch.zeros(64, 1024)
    old = sample.CHUNK, sample.BLOCK
    sample.CHUNK, sample.BLOCK = 1024, 256
    try:
        drawn = sample_gumbel(logits, torch.ones(64), seed=3)
        drawn_bf16 = sample_gumbel(logits[:16].bfloat16(), torch.ones(16), seed=3)
    finally:
        sample.CHUNK, sample.BLOCK = old
    assert len(set(drawn.tolist())) >= 58
    assert set(((drawn % 256) // 64).tolist()) == {0, 1, 2, 3}
    assert drawn[:16].tolist() == drawn_bf16.tolist()


SHARD_IMPLS = {"triton": sample_gumbel_shard, "reference": reference.sample_gumbel_shard}


@pytest.mark.parametrize("impl", SHARD_IMPLS)
@pytest.mark.parametrize("size", [2, 3])
def test_shards_draw_what_the_whole_rows_draw(impl, size):
    """Logits split by columns over `size` ranks (padded: the vocabulary does not divide, and the
    shard boundaries fall inside chunks and tiles): the best (score, column) over the shards,
    lowest column on ties, is the whole rows' draw with the same seed, tempered and greedy rows,
    a greedy tie across two shards included."""
    from engine.distributed.vocab_parallel_sampling import best_of_shards
    from kernels import sample

    vocab = 3 * 1024 + 5
    logits = torch.randn(12, vocab)
    logits[3, [10, vocab - 1]] = 40.0  # a greedy tie between the first and the last shard
    temps = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 0.0, 1.0, 1.0, 0.5, 0.0, 2.0, 1.0])
    width = -(-vocab // size)
    padded = torch.cat([logits, torch.full((12, width * size - vocab), 7.0)], dim=1)  # padding never drawn
    whole = sample_gumbel if impl == "triton" else reference.sample_gumbel
    old = sample.CHUNK, sample.BLOCK
    sample.CHUNK, sample.BLOCK = 1024, 256
    try:
        want = whole(logits, temps, seed=4)
        parts = [SHARD_IMPLS[impl](padded[:, r * width:(r + 1) * width].contiguous(), temps, 4, r * width, vocab)
                 for r in range(size)]
    finally:
        sample.CHUNK, sample.BLOCK = old
    got = best_of_shards(torch.stack(parts))
    assert got.tolist() == want.tolist()
    assert got[3].item() == 10
    greedy = temps == 0
    assert got[greedy].tolist() == logits[greedy].argmax(-1).tolist()
    for r, pair in enumerate(parts):  # each shard's own best: a column of its own
        assert pair.shape == (2, 12) and pair.dtype == torch.float32
        assert ((pair[1] >= r * width) & (pair[1] < min((r + 1) * width, vocab))).all()


def test_a_shard_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="col_start=12 is invalid"):
        sample_gumbel_shard(torch.zeros(2, 4), torch.zeros(2), 0, 12, 12)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="temperatures.shape"):
        sample_gumbel(torch.zeros(2, 8), torch.zeros(3), 0)
    with pytest.raises(ValueError, match="logits"):
        sample_gumbel(torch.zeros(8, 2).t(), torch.zeros(2), 0)
    with pytest.raises(ValueError, match="logits.dtype"):
        sample_gumbel(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2), 0)


@pytest.mark.gpu
def test_gpu_sampling_at_engine_shape():
    """256 rows x Qwen3's 151936-token vocab on the GPU: greedy rows exact, tempered rows follow
    the distribution (a peaked 8-token head, checked over 20000 rows)."""
    logits = torch.randn(256, 151936, device="cuda")
    temps = torch.tensor([0.0, 0.6] * 128, device="cuda")
    out = sample_gumbel(logits, temps, seed=5)
    assert out[::2].tolist() == logits[::2].argmax(-1).tolist()
    assert ((out >= 0) & (out < 151936)).all()
    half = logits.bfloat16()  # the engine's logits dtype: read as is
    assert sample_gumbel(half, temps, seed=5)[::2].tolist() == half[::2].argmax(-1).tolist()
    base = torch.full((4096,), float("-inf"), device="cuda")
    base[:8] = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2])
    rows = 20000
    drawn = sample_gumbel(base.repeat(rows, 1), torch.full((rows,), 0.7, device="cuda"), seed=9)
    freq = torch.bincount(drawn, minlength=8).double().cpu() / rows
    p = torch.softmax(base[:8].double().cpu() / 0.7, 0)
    assert freq.shape[0] == 8 and ((freq - p).abs() <= 5 * (p * (1 - p) / rows).sqrt() + 1e-4).all()


@pytest.mark.gpu
def test_gpu_shards_draw_what_the_whole_rows_draw():
    """Qwen3's 151936-token vocab over 2 and 4 ranks' columns at 256 bf16 rows on the GPU: the
    shards' best is the whole rows' draw, tempered and greedy rows, token for token."""
    from engine.distributed.vocab_parallel_sampling import best_of_shards

    vocab = 151936
    logits = torch.randn(256, vocab, device="cuda").bfloat16()
    temps = torch.tensor([0.0, 0.6, 1.0, 1.7] * 64, device="cuda")
    want = sample_gumbel(logits, temps, seed=12)
    for size in (2, 4):
        width = -(-vocab // size)
        padded = torch.nn.functional.pad(logits, (0, width * size - vocab), value=9.0)
        parts = [sample_gumbel_shard(padded[:, r * width:(r + 1) * width].contiguous(), temps, 12, r * width, vocab)
                 for r in range(size)]
        assert best_of_shards(torch.stack(parts)).tolist() == want.tolist()
