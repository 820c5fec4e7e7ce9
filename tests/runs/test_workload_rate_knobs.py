"""A workload knob is used or refused, never ignored: `burstiness` shapes gamma arrivals only, and a
trace (replay, azure, burstgpt, mooncake) replays its own arrival times, so a `rate` is refused."""
from __future__ import annotations

from contextlib import nullcontext

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from workload_helpers import VOCAB

from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.workloads import build_workload
from tests.property_settings import examples

SYNTHETIC = {"kind": "synthetic", "num_requests": 50, "rate": 10.0, "prompt_len": {"dist": "fixed", "value": 8},
             "output_len": {"dist": "fixed", "value": 4}, "vocab_size": VOCAB}
TRACES = {"replay": "experiments/lib/workloads/example_trace.jsonl",
          "azure": "experiments/lib/workloads/fixtures/azure_llm_2023.csv",
          "burstgpt": "experiments/lib/workloads/fixtures/burstgpt.csv",
          "mooncake": "experiments/lib/workloads/fixtures/mooncake.jsonl"}


def build(cfg):
    return build_workload(cfg, seed=0, vocab_size=VOCAB)


@settings(max_examples=examples(20), deadline=None)
@given(st.sampled_from(["poisson", "offline"]),
       st.one_of(st.floats(-10, 10, allow_nan=False), st.integers(-5, 5)).filter(lambda b: b != 1))
def test_a_burstiness_other_arrivals_would_ignore_is_refused(arrival, burstiness):
    with pytest.raises(ValueError, match=rf"^workload.burstiness={burstiness!r} is invalid with "
                                         rf"workload.arrival={arrival}: .* set workload.arrival=gamma"):
        build({**SYNTHETIC, "arrival": arrival, "burstiness": burstiness})


def test_poisson_takes_burstiness_one_or_null_and_gamma_takes_any_positive_one():
    for burstiness in (1, 1.0, None):
        assert len(build({**SYNTHETIC, "arrival": "poisson", "burstiness": burstiness})) == 50
    assert len(build({**SYNTHETIC, "arrival": "gamma", "burstiness": 0.1})) == 50
    with pytest.raises(ValueError, match=r"^workload.burstiness=-5 is invalid: must be a finite number > 0"):
        build({**SYNTHETIC, "arrival": "gamma", "burstiness": -5})


@pytest.mark.parametrize("kind", sorted(TRACES))
def test_every_trace_refuses_a_rate_pointing_at_time_scale(kind):
    cfg = {"kind": kind, "path": TRACES[kind], **({"drop_empty": True} if kind == "burstgpt" else {})}
    with pytest.warns(UserWarning) if kind == "burstgpt" else nullcontext():  # its failed requests, left out
        assert len(build(cfg)) > 0
    with pytest.raises(ValueError, match=rf"^workload.rate=10 is invalid with workload.kind={kind}: a trace replays "
                                         r"its own arrival times; scale them with workload.time_scale"):
        build({**cfg, "rate": 10})
    # every trace preset holds the key, so an override reaches this check rather than Hydra's
    assert compose_cfg([f"workload={kind}", "workload.rate=10"]).workload.rate == 10
