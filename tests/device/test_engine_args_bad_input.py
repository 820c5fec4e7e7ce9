"""`EngineArgs` refuses a bad value where it is built, with a ValueError naming the field, the value
and what is allowed, never a torch error from deep inside the runner once the model loads."""
from __future__ import annotations

import pytest

from engine.config import CacheConfig, RunnerConfig
from engine.engine_args import EngineArgs
from engine.model_loader import load_model_config
from engine.offline.llm import LLM
from policies.request import SamplingParams

SEED_ALLOWED = r"an integer in \[-2\*\*63, 2\*\*63 - 1\]"
BAD_SEEDS = (("text", "x", r"seed='x' is invalid"), ("float", 2.5, r"seed=2.5 is invalid"),
             ("bool", True, r"seed=True is invalid"), ("too-big", 2**70, r"seed=1180591620717411303424 is invalid"),
             ("too-small", -2**63 - 1, r"seed=-9223372036854775809 is invalid"), ("list", [1], r"seed=\[1\] is invalid"))


@pytest.mark.parametrize(("seed", "match"), [r[1:] for r in BAD_SEEDS], ids=[r[0] for r in BAD_SEEDS])
def test_a_bad_seed_is_named_when_the_arguments_are_built(seed, match):
    with pytest.raises(ValueError, match=match) as info:
        EngineArgs(model="tiny-llama", seed=seed)
    assert "seed=" in str(info.value) and "2**63" in str(info.value)
    with pytest.raises(ValueError, match=f"{match}: {SEED_ALLOWED}"):
        EngineArgs.from_dict({"model": "tiny-llama", "seed": seed})


@pytest.mark.parametrize("seed", [0, -1, 7, 2**63 - 1, -2**63])
def test_seeds_in_range_are_taken(seed):
    assert EngineArgs(model="tiny-llama", seed=seed).seed == seed


def test_none_is_the_default_seed():
    assert EngineArgs(model="tiny-llama", seed=None).seed == 0 == EngineArgs(model="tiny-llama").seed


def test_the_runner_config_checks_the_seed_too():
    """What a profile or a tensor-parallel worker builds a runner from, without EngineArgs."""
    with pytest.raises(ValueError, match=r"seed=2.5 is invalid"):
        RunnerConfig(load_model_config("tiny-llama"), CacheConfig(num_gpu_blocks=8), max_num_batched_tokens=64,
                     max_num_seqs=4, max_model_len=64, seed=2.5)


def test_seed_none_gives_the_dummy_weights_of_seed_zero():
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    small = {"num_gpu_blocks": 16, "swap_space": 0, "max_model_len": 64}
    outs = [LLM("tiny-llama", seed=seed, **small).generate([[1, 2, 3]], greedy, use_tqdm=False)[0]
            for seed in (None, 0)]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


DEVICES = r"'cpu', 'cuda' or 'cuda:<index>'"
BAD_DEVICES = (("tpu", "tpu", r"device='tpu' is invalid"), ("cuda-text-index", "cuda:x", r"device='cuda:x' is invalid"),
               ("cuda-negative", "cuda:-1", r"device='cuda:-1' is invalid"),
               ("cpu-index", "cpu:0", r"device='cpu:0' is invalid"), ("number", 0, r"device=0 is invalid"),
               ("empty", "", r"device='' is invalid"))


@pytest.mark.parametrize(("device", "match"), [r[1:] for r in BAD_DEVICES], ids=[r[0] for r in BAD_DEVICES])
def test_a_bad_device_is_named_when_the_arguments_are_built(device, match):
    with pytest.raises(ValueError, match=f"{match}: {DEVICES}"):
        EngineArgs(model="tiny-llama", device=device)


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:0", "cuda:7"])
def test_device_forms_are_taken(device):
    assert EngineArgs(model="tiny-llama", device=device).device == device


def test_a_cuda_device_this_machine_lacks_is_named_when_resolved(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineArgs(model="tiny-llama").resolve_device() == "cpu"
    with pytest.raises(ValueError, match=r"device='cuda:0' is invalid: CUDA is not available here"):
        EngineArgs(model="tiny-llama", device="cuda:0").resolve_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert EngineArgs(model="tiny-llama", device="cuda:0").resolve_device() == "cuda:0"
    with pytest.raises(ValueError, match=r"device='cuda:1' is invalid: this machine has 1 CUDA device\(s\), "
                                         r"cuda:0 to cuda:0"):
        EngineArgs(model="tiny-llama", device="cuda:1").resolve_device()


def test_the_decode_device_of_a_disaggregated_pair_is_checked_the_same_way():
    from engine.disagg.config import DisaggregationConfig
    with pytest.raises(ValueError, match=rf"disaggregation.decode_device='cuda:x' is invalid: {DEVICES}"):
        DisaggregationConfig.parse("prefill=1,decode=1,decode_device=cuda:x")
    assert DisaggregationConfig.parse("prefill=1,decode=1,decode_device=cuda:1").decode_device == "cuda:1"
