"""The start-up size check and the admission rule are one rule (`policies.blocks.base.fits_idle_pool`):
a pool the check accepts runs every request within max_model_len, whatever the watermark."""
from __future__ import annotations

import pytest
from engine_helpers import save_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples
from scheduler_helpers import make_scheduler, request, run_to_end

from engine import EngineArgs, LLMEngine, SamplingParams
from policies.blocks import BLOCK_MANAGERS
from policies.blocks.base import fits_idle_pool


@settings(max_examples=examples(60), deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]), max_model_len=st.integers(8, 300),
       watermark=st.sampled_from([0.0, 0.01, 0.1, 0.3]), extra_blocks=st.integers(-2, 2),
       blocks=st.sampled_from(BLOCK_MANAGERS.names()))
def test_a_pool_the_check_accepts_runs_the_longest_prompt(block_size, max_model_len, watermark, extra_blocks,
                                                          blocks):
    num_gpu_blocks = max(1, -(-max_model_len // block_size) + extra_blocks)
    scheduler = make_scheduler(blocks=blocks, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                               watermark=watermark, max_model_len=max_model_len,
                               max_num_batched_tokens=max_model_len)
    scheduler.add(request("long", max_model_len - 1, max_tokens=4, ignore_eos=True), 0.0)
    run_to_end(scheduler)
    (row,) = scheduler.recorder.requests
    assert (row["finish_reason"] == "length") is fits_idle_pool(max_model_len, block_size, num_gpu_blocks)


def test_the_watermark_does_not_abort_a_prompt_the_check_accepted():
    # 128 blocks of 16 hold max_model_len=2048; the 1% watermark (1 block) must not make a 2040-token
    # prompt (128 blocks) too long.
    assert fits_idle_pool(2048, 16, 128) and not fits_idle_pool(2049, 16, 128)
    scheduler = make_scheduler(block_size=16, num_gpu_blocks=128, watermark=0.01, max_model_len=2048,
                               max_num_batched_tokens=2048)
    scheduler.add(request("r", 2040, max_tokens=8, ignore_eos=True), 0.0)
    run_to_end(scheduler)
    assert [(r["finish_reason"], r["output_len"]) for r in scheduler.recorder.requests] == [("length", 8)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("capacity") / "llama"
    save_tiny_model(path, "llama", seed=1)
    return str(path)


def test_engine_start_up_check_and_admission_agree(tiny):
    args = {"model": tiny, "block_size": 16, "max_model_len": 256, "watermark": 0.1, "swap_space": 0.01}
    too_small = (r"num_gpu_blocks=15 is invalid: its KV pool of 15 x 16-token blocks cannot hold one "
                 r"max_model_len=256 sequence, which takes 16 of them: set it to at least 16")
    with pytest.raises(ValueError, match=too_small):
        EngineArgs(num_gpu_blocks=15, **args).check()  # before anything loads
    with pytest.raises(ValueError, match=too_small):
        LLMEngine(EngineArgs(num_gpu_blocks=15, **args))
    engine = LLMEngine(EngineArgs(num_gpu_blocks=16, **args))  # the smallest pool the check accepts
    engine.add_request("r", list(range(250)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    (out,) = finished
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6
