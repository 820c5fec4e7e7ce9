"""`StopRule`: the one stop rule the scheduler applies to every sampled token."""
from __future__ import annotations

from scheduler_helpers import request

from policies.sequence import Sequence
from policies.stop_rule import LENGTH, STOPPED, StopRule


def rule(prompt_len=4, max_model_len=64, **params) -> StopRule:
    seq = Sequence.from_request(0, request("r", prompt_len, eos=0, **params))
    return StopRule.of(seq, max_model_len, None)


def test_a_stop_wins_over_the_length_limit_once_min_tokens_are_out():
    r = rule(max_tokens=3, min_tokens=2)  # 4-token prompt: outputs 1, 2, 3 sampled at computed 4, 5, 6
    assert (r.stop_len, r.min_len, r.stops) == (6, 5, frozenset({0}))
    assert r.ending(0, False, 4) is None  # eos as output 1: masked by min_tokens
    assert r.ending(0, False, 5) is STOPPED and r.ending(7, True, 5) is STOPPED
    assert r.ending(7, False, 5) is None and r.ending(7, False, 6) is LENGTH and r.ending(0, False, 6) is STOPPED


def test_max_model_len_and_ignore_eos():
    r = rule(max_tokens=100, max_model_len=10, ignore_eos=True, stop_token_ids=[5])
    assert (r.stop_len, r.stops) == (9, frozenset({5}))
    assert r.ending(0, False, 8) is None and r.ending(5, False, 8) is STOPPED and r.ending(0, False, 9) is LENGTH
    assert rule(ignore_eos=True).stops is None


def test_decode_steps_before_end():
    r = rule(max_tokens=8, min_tokens=3)  # stop_len 11, min_len 6
    assert r.decode_steps_before_end(5, token=7) == 5  # steps leave 6..10 computed, the 6th reaches 11
    assert r.decode_steps_before_end(5, token=0) == 0  # eos at computed 6 >= min_len ends the first step
