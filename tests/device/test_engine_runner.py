"""ModelRunner on CPU, driven like the scheduler would: greedy output equal to transformers'
generate, with chunked prefill, after swap and recompute preemption, with copy-on-write forks;
seeded sampling reproducible; clear errors for bad sizes."""
import dataclasses

import pytest
import torch

from engine.config import CacheConfig
from engine.device import model_runner
from engine.device.model_runner import ModelRunner
from engine.model_loader import load_model_config
from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.request import SamplingParams
from tests.engine_model_helpers import (
    ARCHS,
    BlockAllocator,
    generate,
    hf_twin,
    make_seqs,
    random_prompts,
    step,
)

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=64)


def make_runner(arch="llama", num_gpu_blocks=128, **kw) -> ModelRunner:
    cfg = load_model_config(f"tiny-{arch}")
    cache = CacheConfig(block_size=BLOCK, num_gpu_blocks=num_gpu_blocks, swap_space=kw.pop("swap_space", 0.001))
    return ModelRunner(cfg, cache, max_num_batched_tokens=256, max_num_seqs=16, max_model_len=128,
                       device="cpu", seed=kw.pop("seed", 0), **kw)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [10_000, 6])
def test_greedy_matches_transformers_generate(arch, chunk):
    runner = make_runner(arch)
    hf = hf_twin(runner.model)
    prompts = random_prompts([5, 17, 1, 30], runner.vocab_size, seed=1)
    ours = generate(runner, make_seqs(prompts, GREEDY), max_tokens=10, chunk=chunk)
    assert ours == [hf_greedy(hf, p, 10) for p in prompts]


def test_swap_and_recompute_preemption_give_unpreempted_tokens():
    prompts = random_prompts([9, 14, 3], 256, seed=2)
    reference = generate(make_runner(), make_seqs(prompts, GREEDY), max_tokens=12)

    runner = make_runner()
    alloc = BlockAllocator(BLOCK, runner.num_gpu_blocks)
    seqs = make_seqs(prompts, GREEDY)
    for _ in range(4):
        step(runner, alloc, seqs, 10_000)
    victim_swap, victim_recompute = seqs[0], seqs[1]
    # swap out seq 0 to CPU blocks 5.., scribble over its GPU blocks, swap in to fresh blocks
    old = list(victim_swap.block_table)
    runner.execute(SchedulerOutput(now=0, swap_out={g: 5 + i for i, g in enumerate(old)}))
    for cache in runner.kv_cache.k_caches + runner.kv_cache.v_caches:
        cache[old] = 1e3
    new = [alloc.free.pop(0) for _ in old]
    victim_swap.block_table = new
    # recompute: seq 1 loses its KV and recomputes prompt + generated tokens in the same step
    alloc.release(victim_recompute)
    victim_recompute.num_computed_tokens = 0
    step(runner, alloc, seqs, 10_000,
         SchedulerOutput(now=0, swap_in={5 + i: g for i, g in enumerate(new)}))
    while any(s.num_output_tokens < 12 for s in seqs):
        step(runner, alloc, [s for s in seqs if s.num_output_tokens < 12], 10_000)
    assert [s.output_token_ids for s in seqs] == reference


def test_copy_on_write_fork_continues_like_parent():
    runner = make_runner("qwen3")
    prompt = random_prompts([10], 256, seed=3)[0]  # 10 tokens: last block (8..11) half full
    expected = generate(make_runner("qwen3"), make_seqs([prompt], GREEDY), max_tokens=6)[0]
    alloc = BlockAllocator(BLOCK, runner.num_gpu_blocks)
    parent = make_seqs([prompt], GREEDY)[0]
    step(runner, alloc, [parent], 10_000)
    child = parent.fork(1, sample_index=1)
    child.block_table = parent.block_table[:-1] + [alloc.free.pop(0)]  # shared prefix, own last block
    out = SchedulerOutput(now=0, copy=[(parent.block_table[-1], child.block_table[-1])])
    step(runner, alloc, [parent, child], 10_000, out)
    while parent.num_output_tokens < 6:
        step(runner, alloc, [parent, child], 10_000)
    assert parent.output_token_ids == child.output_token_ids == expected


def test_seeded_parallel_sampling_reproducible():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, n=3, max_tokens=8)
    prompts = random_prompts([6, 11], 256, seed=4)

    def run() -> tuple[list[int], list[int], list[int]]:
        runner = make_runner("qwen2")
        seqs = make_seqs(prompts, [params, SamplingParams(temperature=0.8, max_tokens=8)])
        alloc = BlockAllocator(BLOCK, runner.num_gpu_blocks)
        for s in seqs:
            alloc.ensure(s, s.num_tokens)
        res = runner.execute(SchedulerOutput(now=0, scheduled=[ScheduledSeq(seqs[0], 6, 3),
                                                                ScheduledSeq(seqs[1], 11, 1)]))
        assert len(res[0].token_ids) == 3 and len(res[1].token_ids) == 1
        parent = seqs[0]
        parent.num_computed_tokens = 6
        kid = parent.fork(10, sample_index=1)
        parent.token_ids.append(res[0].token_ids[0])
        kid.token_ids.append(res[0].token_ids[1])
        kid.block_table = parent.block_table[:-1] + [alloc.free.pop(0)]
        step(runner, alloc, [parent, kid], 10_000,
             SchedulerOutput(now=0, copy=[(parent.block_table[-1], kid.block_table[-1])]))
        for _ in range(3):
            step(runner, alloc, [parent, kid], 10_000)
        return res[0].token_ids, parent.output_token_ids, kid.output_token_ids

    first, again = run(), run()
    assert first == again
    assert first[1] != first[2]  # the child draws from its own generator


def test_logprobs_returned_through_runner():
    runner = make_runner()
    prompts = random_prompts([7], 256, seed=5)
    seqs = make_seqs(prompts, SamplingParams(temperature=0, logprobs=2))
    res = step(runner, BlockAllocator(BLOCK, runner.num_gpu_blocks), seqs, 10_000)
    (lp,) = res[0].logprobs
    assert res[0].token_ids[0] in lp and len(lp) == 2 and max(lp.values()) == lp[res[0].token_ids[0]]


def test_cpu_kv_cache_has_a_stated_default(caplog, monkeypatch):
    """Without num_gpu_blocks a CPU runner takes what max_num_seqs full-length requests need, at
    most CPU_KV_CACHE_GIB, and says so."""
    with caplog.at_level("WARNING", logger="servelab.engine"):
        runner = make_runner(num_gpu_blocks=None)
    assert runner.num_gpu_blocks == 16 * 128 // BLOCK  # max_num_seqs requests of max_model_len tokens
    assert "num_gpu_blocks not set" in caplog.text and "at most 4 GiB" in caplog.text
    per_block = BLOCK * runner.model_config.kv_bytes_per_token_in(runner.dtype.itemsize)
    monkeypatch.setattr(model_runner, "CPU_KV_CACHE_GIB", 200 * per_block / 2**30)
    assert make_runner(num_gpu_blocks=None).num_gpu_blocks == 200  # the cap


def test_bad_sizes_raise_clear_errors():
    with pytest.raises(ValueError, match=r"num_gpu_blocks=10 is invalid: its KV pool of 10 x 4-token blocks "
                                         r"cannot hold one max_model_len=128 sequence, which takes 32 of them"):
        make_runner(num_gpu_blocks=10)
    cfg = load_model_config("tiny-llama")
    with pytest.raises(ValueError, match="max_model_len=4096"):
        ModelRunner(cfg, CacheConfig(num_gpu_blocks=8), max_num_batched_tokens=8, max_num_seqs=2,
                    max_model_len=4096)
    with pytest.raises(ValueError, match="dtype='int8'"):
        make_runner(dtype="int8")
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        make_runner(attention_backend="flash")
    runner = make_runner()
    with pytest.raises(ValueError, match="swap_out GPU block ids"):
        runner.execute(SchedulerOutput(now=0, swap_out={10_000: 0}))
    seq = make_seqs([[1, 2, 3, 4, 5]], GREEDY)[0]
    seq.block_table = [0]
    with pytest.raises(ValueError, match="too few for 5 tokens"):
        runner.execute(SchedulerOutput(now=0, scheduled=[ScheduledSeq(seq, 5, 1)]))
    seq.block_table = [0, 1]
    with pytest.raises(ValueError, match="num_samples=1 but the step ends at token 3 of 5"):
        runner.execute(SchedulerOutput(now=0, scheduled=[ScheduledSeq(seq, 3, 1)]))



@pytest.mark.parametrize("max_model_len", [128, 126])  # 126: the last block only partly within it
def test_a_step_past_max_model_len_is_refused_before_the_forward(max_model_len):
    """A step built by hand (a profile grid's synthetic step) whose sequence runs past max_model_len
    has no rotary row for its last positions: a ValueError naming the sequence, not an IndexError
    on the CPU or a device-side assert on a GPU."""
    cfg = load_model_config("tiny-llama")
    runner = ModelRunner(cfg, CacheConfig(block_size=BLOCK, num_gpu_blocks=128, swap_space=0.001),
                         max_num_batched_tokens=256, max_num_seqs=16, max_model_len=max_model_len, device="cpu")
    def prefill(num_tokens: int) -> SchedulerOutput:
        seq = make_seqs([[1] * num_tokens], GREEDY)[0]
        seq.block_table = list(range(-(-num_tokens // BLOCK)))
        return SchedulerOutput(now=0, scheduled=[ScheduledSeq(seq, num_tokens, 1)])
    assert len(runner.execute(prefill(max_model_len))) == 1
    with pytest.raises(ValueError, match=rf"seq 0: .* up to {max_model_len + 1}, past max_model_len={max_model_len}"):
        runner.execute(prefill(max_model_len + 1))
    decode = make_seqs([[1] * max_model_len], GREEDY)[0]  # its next token at position max_model_len
    decode.token_ids.append(2)
    decode.num_computed_tokens = max_model_len
    decode.block_table = list(range(max_model_len // BLOCK + 1))
    with pytest.raises(ValueError, match=f"past max_model_len={max_model_len}"):
        runner.execute(SchedulerOutput(now=0, scheduled=[ScheduledSeq(decode, 1, 1)]))


def test_cache_config_and_swap_pool_size():
    with pytest.raises(ValueError, match="block_size=12"):
        CacheConfig(block_size=12)
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        CacheConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="swap_space=-1"):
        CacheConfig(swap_space=-1)
    runner = make_runner(swap_space=1 / 1024)  # 1 MiB; a tiny-llama block is 2*2*4*2*16*4 B = 2 KiB
    assert runner.num_cpu_blocks == 512
    assert runner.kv_cache.cpu_k_caches[0].shape == (512, BLOCK, 2, 16)
    assert dataclasses.asdict(runner.cache_config)["block_size"] == BLOCK
