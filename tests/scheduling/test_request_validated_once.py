"""A request's costly checks (prompt token ids, sampling params) run once: workloads build requests
validated, and a later `validate` (the scheduler's `add`) checks them again only where they changed."""
from __future__ import annotations

import pytest

from experiments.lib.workloads import Workload
from policies.request import Request, SamplingParams


def _request(ids: list) -> Request:
    return Request("r0", ids, SamplingParams(max_tokens=4))


def test_a_workload_refuses_a_bad_request_when_built():
    with pytest.raises(ValueError, match=r"prompt_token_ids=\[-3\] is invalid"):
        Workload("w", [_request([1, 2, -3])], [4])


def test_a_workload_builds_its_requests_validated():
    good = _request([1, 2, 3])
    Workload("w", [good], [4])
    assert good._validated is not None and good._validated[0] is good.prompt_token_ids


@pytest.mark.parametrize(("change", "match"), [
    ("new-list", r"prompt_token_ids=\[-1\] is invalid"),
    ("longer-list", r"prompt_token_ids=\[-1\] is invalid"),
    ("new-params", r"max_tokens=0 is invalid"),
    ("vocab", r"prompt_token_ids=\[7\] is invalid"),
    ("priority", r"priority=1.5 is invalid"),
    ("too-long", r"longer than max_model_len=3"),
])
def test_a_validated_request_is_checked_again_where_it_changed(change, match):
    req = _request([1, 2, 7])
    req.validate(None)
    max_model_len, vocab = None, None
    if change == "new-list":
        req.prompt_token_ids = [1, -1]
    elif change == "longer-list":
        req.prompt_token_ids.append(-1)
    elif change == "new-params":
        params = SamplingParams()
        params.max_tokens = 0
        req.sampling_params = params
    elif change == "vocab":
        vocab = 5
    elif change == "priority":
        req.priority = 1.5
    else:
        req.prompt_token_ids.append(4)
        max_model_len = 3
    with pytest.raises(ValueError, match=match):
        req.validate(max_model_len, vocab)


class _CountingList(list):
    """A prompt that counts the scans of its token ids."""

    scans = 0

    def __iter__(self):
        _CountingList.scans += 1
        return super().__iter__()


def test_a_workload_run_again_scans_no_prompt_again():
    from policies.blocks.paged import PagedBlockManager
    from policies.policy.fcfs import FCFSPolicy
    from policies.scheduler import Scheduler
    from policies.scheduler_config import SchedulerConfig

    _CountingList.scans = 0
    workload = Workload("w", [_request(_CountingList([1, 2, 3]))], [4])
    built = _CountingList.scans
    assert built > 0
    copy = workload.fresh()
    assert _CountingList.scans == built
    scheduler = Scheduler(SchedulerConfig(), FCFSPolicy(), PagedBlockManager(16, 64, 0))
    scheduler.add(copy.requests[0], 0.0)
    assert _CountingList.scans == built + 1  # the sequence's own copy of the prompt, no check
    assert copy.requests[0].sampling_params is not workload.requests[0].sampling_params
