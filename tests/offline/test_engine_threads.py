"""`LLMEngine.add_request` / `abort_request` from other threads than the stepping one (as an
online server calls them): a duplicate id is refused in the caller without harm, and every request
ends finished or aborted while another thread steps."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from policies.lifecycle import Lifecycle
from policies.request import SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineArgs(model="tiny-llama", num_gpu_blocks=512, swap_space=0, max_model_len=64,
                                block_size=4, max_num_seqs=64, max_num_batched_tokens=256))


@pytest.fixture
def fast_switching():
    """Switch threads as often as the interpreter allows, so races show up within a few hundred tries."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def _drain(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    return outputs


def test_same_id_from_two_threads_is_added_once(engine, fast_switching, monkeypatch):
    """The scheduler's arrival is slowed down so that the second add runs while the first is
    between its id check and its arrival: without a hand-over both would get in."""
    arrive = Lifecycle.arrive

    def slow_arrive(self, request, now):
        time.sleep(0.002)
        arrive(self, request, now)

    monkeypatch.setattr(Lifecycle, "arrive", slow_arrive)
    engine.reset()
    pairs, errors = 40, []
    barrier = threading.Barrier(2)

    def add(i: int) -> None:
        barrier.wait()
        try:
            engine.add_request(f"dup-{i}", [1, 2, 3], ONE)
        except ValueError as e:
            errors.append(str(e))

    for i in range(pairs):
        threads = [threading.Thread(target=add, args=(i,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(errors) == pairs, "both adds of one id succeeded"
    assert all("request_id='dup-" in e and "already added" in e for e in errors)
    outputs = _drain(engine)
    assert sorted(o.request_id for o in outputs) == sorted(f"dup-{i}" for i in range(pairs))
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_adds_and_aborts_while_another_thread_steps(engine, fast_switching):
    engine.reset()
    outputs, failures = [], []
    done = threading.Event()

    def stepper() -> None:
        try:
            while not done.is_set() or engine.has_unfinished_requests():
                outputs.extend(o for o in engine.step() if o.finished)
        except Exception as e:  # noqa: BLE001 (reported by the assertion below)
            failures.append(repr(e))

    thread = threading.Thread(target=stepper)
    thread.start()
    try:
        for i in range(200):
            engine.add_request(f"r{i}", [1 + i % 200, 2, 3], SamplingParams(temperature=0.0, max_tokens=4,
                                                                             ignore_eos=True))
            if i % 3 == 0:
                engine.abort_request(f"r{i // 2}")
            if i % 50 == 0:
                with pytest.raises(ValueError, match="request_id='r0'"):
                    engine.add_request("r0", [1], ONE)
    finally:
        done.set()
        thread.join(timeout=120)
    assert not thread.is_alive() and failures == []
    by_id = {o.request_id: o.outputs[0] for o in outputs}
    assert sorted(by_id) == sorted(f"r{i}" for i in range(200))
    assert all(c.finish_reason in ("length", "abort:user") for c in by_id.values())
    assert all(len(c.token_ids) == 4 for c in by_id.values() if c.finish_reason == "length")
    assert not engine.has_unfinished_requests()
