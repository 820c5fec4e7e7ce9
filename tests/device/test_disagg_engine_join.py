"""The decode engine of a disaggregated pair on CPU (gloo) as tests/device/test_disagg_engine.py,
with received requests joining the step after the one in flight (`join_ahead`, policies/lookahead.py)
and without (`decode_args={"join_ahead": False}`, the old rule): greedy tokens equal the co-located
engine's either way (a received request's first decode step reads the KV scattered into its blocks),
and with the rule on, the decode engine's steps not scheduled ahead are its cold starts alone (the
step before each left nothing running), however the receives fall between its steps."""
from __future__ import annotations

import pytest
from disagg_helpers import pipeline_breaks
from engine_helpers import ragged_prompts
from test_disagg_engine import ARGS, TIMEOUT_S, _run

from engine.disagg.config import DisaggregationConfig
from engine.disagg.pd_engine import DisaggregatedEngine
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from policies.request import SamplingParams

# Prompts prefilled one or two a step (32 tokens), each decoded for 24 tokens while the later ones
# arrive; the KV pool holds them all (no preemption: a step that might preempt is decided
# synchronously).
ENGINE = {**ARGS, "num_gpu_blocks": 256}
PROMPTS = ragged_prompts(16, seed=3, min_len=3, max_len=30)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    with LLMEngine(EngineArgs(**ENGINE)) as engine:
        yield _run(engine, PROMPTS, GREEDY)


@pytest.mark.parametrize("join_ahead", [True, False], ids=["join_ahead", "join_sync"])
def test_received_requests_join_a_step_scheduled_ahead_and_read_their_kv(reference, join_ahead):
    config = DisaggregationConfig(transfer_timeout_s=TIMEOUT_S, decode_args={"join_ahead": join_ahead})
    pair = DisaggregatedEngine(EngineArgs(**ENGINE), config)
    try:
        assert _run(pair, PROMPTS, GREEDY) == reference
        assert len({row["request_id"] for row in pair.decode_rows}) == len(PROMPTS)
        joins, breaks = pipeline_breaks(pair.decode_steps)
        if join_ahead:  # the old rule breaks the pipeline at about every join while decoding (3-4 here)
            assert breaks == 0, f"{breaks} steps not scheduled ahead after {joins} joins while decoding"
    finally:
        pair.close()


@pytest.mark.parametrize("value", ["maybe", 1, None])
def test_join_ahead_must_be_a_bool_before_anything_loads(value):
    with pytest.raises(ValueError, match=r"join_ahead=.* is invalid: must be True or False"):
        EngineArgs(**{**ENGINE, "join_ahead": value})
