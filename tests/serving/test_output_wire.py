"""A step's outputs cross the core's pipe unchanged (engine/online/output_wire.py): whatever form the
core picks for each, the front end rebuilds the very `RequestOutput` the engine made, prompt and
metrics included, and running streams' plain tokens go in the compact form."""
from __future__ import annotations

import pickle

from engine.offline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.online.engine_stats import RequestStats
from engine.online.output_wire import OutputPacker, OutputReader


def out(rid: str, tokens: list[int], *, text: str = "", finished: bool = False, reason: str | None = None,
        preempted: int = 0, logprobs=None, cached: int = 0, error: str | None = None,
        samples: int = 1) -> RequestOutput:
    metrics = RequestMetrics(1.0, 1.5, 2.0, 9.0 if finished else None, preempted)
    outs = [CompletionOutput(i, text, list(tokens), reason, None, logprobs) for i in range(samples)]
    return RequestOutput(rid, f"prompt of {rid}", [1, 2, 3, len(rid)], outs, finished, metrics, cached, error)


def test_every_form_rebuilds_the_engines_output():
    steps = [
        [out("a", [5], text="x", cached=16), out("b", [6], samples=2)],
        [out("a", [7], text="y", cached=16), out("b", [8], samples=2)],  # a: compact; b: two samples, full
        [out("a", [9], cached=16, preempted=1), out("c", [4], finished=True, reason="length")],  # new metrics; c alone
        [out("a", [10], cached=16, preempted=1, logprobs=[{10: -0.5}])],  # logprobs: full
        [out("a", [11], cached=16, preempted=1)],  # compact again
        [out("a", [12], cached=16, preempted=1, error="RuntimeError: boom", finished=True, reason="abort:error")],
        [out("b", [13], finished=True, reason="stop", samples=2)],
    ]
    packer, reader = OutputPacker(), OutputReader()
    forms = []
    for step in steps:
        packed = pickle.loads(pickle.dumps([packer.pack(o) for o in step]))  # what crosses the pipe
        forms.append([len(p) for p in packed])
        record = RequestStats("c", "length", 4, 1, 0.1, [], 0.2)
        got = list(reader.read(packed, [record]))
        assert [o for o, _ in got] == step
        assert [r for o, r in got] == [record if o.request_id == "c" else None for o in step]
    assert forms == [[8, 8], [3, 8], [8, 8], [8], [3], [8], [8]]
    assert reader._known == {} and packer._sent == {}  # nothing kept once every request ended


def test_the_prompt_crosses_once():
    packer = OutputPacker()
    first, second = packer.pack(out("a", [5])), packer.pack(out("a", [6]))
    assert first[3] == [1, 2, 3, 1] and first[2] == "prompt of a"
    assert second == ("a", [6], "")


def test_a_core_step_crosses_as_builtins_and_comes_back_equal():
    """The step's message names one rebuilding function, none of its dataclasses (pickle's way with
    frozen dataclasses costs a class lookup and a Python-level __setstate__ each, every step)."""
    from engine.online.engine_core import CoreStep
    from engine.online.engine_stats import EngineStats
    from policies.routing.replica_report import ReplicaReport

    packer = OutputPacker()
    step = CoreStep({"x": ValueError("max_tokens=0 is invalid")}, 2, [packer.pack(out("a", [5]))],
                    [RequestStats("c", "length", 4, 1, 0.1, [0.01], 0.2, None, 3.5)],
                    EngineStats(1, 2, 0, 0.25, 0, 40, 7, 3, 9), ReplicaReport(2, 1, 0, 10, 40, 150, 16, (5,), ()))
    wire = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
    for name in (b"CoreStep", b"RequestStats", b"EngineStats", b"ReplicaReport"):
        assert name not in wire
    back = pickle.loads(wire)
    assert type(back) is CoreStep and back.finished == step.finished and back.stats == step.stats
    assert back.report == step.report and back.outputs == step.outputs and back.num_taken == 2
    assert type(back.errors["x"]) is ValueError and str(back.errors["x"]) == "max_tokens=0 is invalid"
