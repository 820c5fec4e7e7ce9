"""A stop token id outside the model's vocabulary can never be sampled, so it would never stop
anything: the engine refuses it as it refuses such an id in a prompt (the field, the ids, the
range), and the other requests of the call or the engine are unharmed."""
from __future__ import annotations

import pytest

from engine.offline.llm import LLM
from policies.request import Request, SamplingParams

VOCAB = 256  # tiny-llama's
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
RANGE = rf"token ids must be integers in \[0, {VOCAB}\) \(the model's vocabulary\)"


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_gpu_blocks=64, swap_space=0, max_model_len=64)


@pytest.mark.parametrize(("ids", "named"), [([VOCAB], r"\[256\]"), ([10**9], r"\[1000000000\]"),
                                            ([3, 300, 7, 400], r"\[300, 400\]")])
def test_generate_names_the_prompt_the_field_the_ids_and_the_range(llm, ids, named):
    good = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    bad = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=ids)
    with pytest.raises(ValueError, match=rf"^prompts\[1\]: stop_token_ids={named} is invalid: {RANGE}"):
        llm.generate([[1, 2, 3], [4, 5]], [GREEDY, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing of the call was left behind
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == good


def test_add_request_refuses_it_and_adds_nothing(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match=rf"^stop_token_ids=\[256\] is invalid: {RANGE}"):
        engine.add_request("bad-stop", [1, 2], SamplingParams(stop_token_ids=[VOCAB]))
    assert not engine.has_unfinished_requests()
    engine.add_request("bad-stop", [1, 2], SamplingParams(max_tokens=2, stop_token_ids=[VOCAB - 1]))  # the id is free
    while engine.has_unfinished_requests():
        engine.step()


def test_a_negative_stop_token_id_is_refused_where_the_params_are_built():
    with pytest.raises(ValueError, match=r"stop_token_ids=\[-1\] is invalid: must be non-negative integers"):
        SamplingParams(stop_token_ids=[-1])


def test_an_id_in_the_vocabulary_still_stops(llm):
    """Only ids past the vocabulary are refused: the ids in it stop as before."""
    first = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[first])
    out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"


def test_without_a_vocabulary_any_id_passes():
    """A request validated without a vocabulary (vocab_size None: the scheduler's own check) passes
    any id; the simulator checks them against its model's (tests/runs/test_stop_token_ids_backends.py)."""
    Request("r", [1, 2], SamplingParams(stop_token_ids=[10**9])).validate(64)
    with pytest.raises(ValueError, match=r"stop_token_ids=\[1000000000\] is invalid"):
        Request("r", [1, 2], SamplingParams(stop_token_ids=[10**9])).validate(64, VOCAB)
