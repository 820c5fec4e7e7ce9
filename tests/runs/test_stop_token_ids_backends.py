"""A workload request whose stop_token_ids lie past the model's vocabulary is refused by the
simulator as the engine refuses it (`SamplingParams.check_vocabulary`, policies/request.py), with
the same message; an id inside the vocabulary runs on both."""
from __future__ import annotations

import dataclasses

import pytest

from experiments.lib import engine_backend, factory
from experiments.lib.backends import run_backend
from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.workloads import Workload
from policies.trace import TraceRecorder

SMALL = ["model=tiny-qwen3", "blocks.num_gpu_blocks=64", "blocks.swap_space_gib=0.01", "scheduler.max_model_len=256",
         "workload=poisson", "workload.num_requests=3", "workload.rate=40", "workload.prompt_len.low=4",
         "workload.prompt_len.high=8", "workload.output_len.low=2", "workload.output_len.high=4",
         "workload.max_tokens=4"]


def first_stops_at(cfg, ids: list[int]) -> Workload:
    """The config's workload, its first request (the first the engine is handed) with `ids` as its
    stop_token_ids."""
    workload = factory.workload(cfg)
    first = workload.requests[0]
    first.sampling_params = dataclasses.replace(first.sampling_params, stop_token_ids=ids)
    return workload


@pytest.mark.parametrize("backend", ["sim", "engine"])
def test_a_stop_token_id_past_the_vocabulary_is_refused_alike(backend):
    cfg = compose_cfg([f"backend={backend}", *SMALL])
    vocab = factory.model_shape(cfg).vocab_size
    message = (rf"^stop_token_ids=\[{vocab}, {vocab + 7}\] is invalid: token ids must be integers in "
               rf"\[0, {vocab}\) \(the model's vocabulary\)$")
    try:
        with pytest.raises(ValueError, match=message):
            run_backend(cfg, first_stops_at(cfg, [3, vocab, vocab + 7]), TraceRecorder())
        recorder = TraceRecorder()
        run_backend(cfg, first_stops_at(cfg, [vocab - 1]), recorder)  # the last id of the vocabulary
        assert len(recorder.requests) == 3
    finally:
        engine_backend.release_engine()


def test_the_simulated_fleet_refuses_it_too():
    cfg = compose_cfg(["backend=sim", "cluster.replicas=2", *SMALL])
    vocab = factory.model_shape(cfg).vocab_size
    with pytest.raises(ValueError, match=rf"^stop_token_ids=\[{vocab}\] is invalid: token ids must be integers"):
        run_backend(cfg, first_stops_at(cfg, [vocab]), TraceRecorder())
