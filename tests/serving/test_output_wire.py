"""A step's outputs cross the core's pipe unchanged (engine/online/output_wire.py): whatever form the
core picks for each, the front end rebuilds the very `RequestOutput` the engine made, prompt and
metrics included, and running streams' plain tokens go in the compact form. The prompt itself
never crosses back: the front end has it; a text prompt's token ids, which only the core has,
cross once."""
from __future__ import annotations

import pickle

from engine.offline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.online.engine_stats import RequestStats
from engine.online.output_wire import OutputPacker, OutputReader


def out(rid: str, tokens: list[int], *, text: str = "", finished: bool = False, reason: str | None = None,
        preempted: int = 0, logprobs=None, cached: int = 0, error: str | None = None,
        samples: int = 1, ids_prompt: bool = False) -> RequestOutput:
    """`ids_prompt`: the request's prompt came as token ids (`prompt` None), else as text."""
    metrics = RequestMetrics(1.0, 1.5, 2.0, 9.0 if finished else None, preempted)
    outs = [CompletionOutput(i, text, list(tokens), reason, None, logprobs) for i in range(samples)]
    return RequestOutput(rid, None if ids_prompt else f"prompt of {rid}", [1, 2, 3, len(rid)], outs, finished,
                         metrics, cached, error)


def told(reader: OutputReader, *outputs: RequestOutput) -> OutputReader:
    """The reader told of each request's prompt as the front end handed it over."""
    for o in outputs:
        reader.sent(o.request_id, o.prompt if o.prompt is not None else list(o.prompt_token_ids))
    return reader


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
    packer, reader = OutputPacker(), told(OutputReader(), steps[0][0], steps[0][1], steps[2][1])
    forms = []
    for step in steps:
        packed = pickle.loads(pickle.dumps([packer.pack(o) for o in step]))  # what crosses the pipe
        forms.append([len(p) for p in packed])
        record = RequestStats("c", "length", 4, 1, 0.1, [], 0.2)
        got = list(reader.read(packed, [record]))
        assert [o for o, _ in got] == step
        assert [r for o, r in got] == [record if o.request_id == "c" else None for o in step]
    assert forms == [[7, 7], [3, 7], [7, 7], [7], [3], [7], [7]]
    assert reader._known == {} and reader._prompts == {} and packer._sent == {}  # nothing kept once all ended


def test_a_text_prompts_ids_cross_once_and_no_prompt_else():
    packer = OutputPacker()
    first, second = packer.pack(out("a", [5])), packer.pack(out("a", [6]))
    assert first[2] == [1, 2, 3, 1] and "prompt of a" not in first  # the ids the core made; never the text
    assert second == ("a", [6], "")
    ids_first = packer.pack(out("b", [5], ids_prompt=True))
    assert ids_first[2] is None and [1, 2, 3, 1] not in ids_first  # the front end has them
    assert packer.pack(out("c", [5], ids_prompt=True, finished=True, reason="length"))[2] is None  # first and last


def test_the_front_end_puts_back_the_prompt_it_handed_over():
    """A token-id prompt's outputs carry the very ids handed over, a text prompt's its text and the
    core's ids; a request refused by the core leaves nothing behind."""
    steps = [[out("ids", [5], ids_prompt=True), out("text", [6])],
             [out("ids", [7], ids_prompt=True), out("text", [8])],
             [out("ids", [9], ids_prompt=True, finished=True, reason="length"),
              out("text", [10], finished=True, reason="stop"), out("once", [3], ids_prompt=True, finished=True)]]
    packer, reader = OutputPacker(), told(OutputReader(), *steps[2])
    reader.sent("refused", [4, 4])
    reader.refused(["refused"])
    for step in steps:
        got = [o for o, _ in reader.read(pickle.loads(pickle.dumps([packer.pack(o) for o in step])), [])]
        assert got == step
    assert reader._known == {} and reader._prompts == {}


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
