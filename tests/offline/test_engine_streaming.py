"""Streaming outputs agree with the final output, for any tokens (property-based): the same scripted
tokens come out as `final_only`, `cumulative` and `delta` requests of one engine; the deltas join
to the final text and token ids, every cumulative text is a prefix of the final one (nothing is
taken back: a stop string is never streamed before it is recognised), and all three end alike.
A scripted runner stands in for the model, so hypothesis can pick the tokens: bytes of the tiny
models' byte tokenizer, multi-byte UTF-8 characters split over tokens included."""
from __future__ import annotations

import pytest
from engine_helpers import byte_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples

from engine.device.sampler import SampleResult
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from policies.request import SamplingParams

KINDS = ("final_only", "cumulative", "delta")


class ScriptedRunner:
    """ModelRunner's interface for `LLMEngine`: sample i of a request reads its script from position i
    on (a prompt sampling n tokens gets the first token of each sample)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.num_gpu_blocks, self.num_cpu_blocks = vocab_size, 256, 0
        self.scripts: dict[str, list[int]] = {}

    def execute(self, out):
        results = {}
        for seq, _, num_samples in out.scheduled:
            if num_samples:
                script = self.scripts[seq.request.request_id.split("/")[0]]
                at = seq.num_output_tokens + seq.sample_index
                results[seq.seq_id] = SampleResult([script[(at + i) % len(script)] for i in range(num_samples)])
        return results

    def launch(self, out, after=None) -> dict:
        """Async scheduling: a step scheduled ahead counts its PENDING tokens as outputs already."""
        return self.execute(out)

    def collect(self, launched: dict) -> dict:
        return launched

    def release(self, seq_ids) -> None:
        pass


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(tmp_path_factory, request):
    from engine_helpers import save_tiny_model

    path = tmp_path_factory.mktemp("script") / "qwen3"
    save_tiny_model(path, "qwen3", seed=1)
    engine = LLMEngine(EngineArgs(model=str(path), max_model_len=256, block_size=8,
                                  async_scheduling=request.param), runner=ScriptedRunner(256))
    engine.looked_past = 0
    return engine


TEXT = st.text(st.sampled_from("ab c.\né€🙂"), min_size=1, max_size=12)


@settings(max_examples=examples(60), deadline=None)
@given(text=TEXT, data=st.data(), min_tokens=st.integers(0, 6), include=st.booleans(), n=st.integers(1, 3))
def test_streamed_outputs_agree_with_the_final_output(engine, text, data, min_tokens, include, n):
    """Stop strings are pieces of the text (or not in it at all), the stop token one of its bytes."""
    script = list(text.encode())
    piece = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 3)).map(lambda p: text[p[0]:p[0] + p[1]])
    stops = data.draw(st.lists(piece | st.sampled_from(["zz", "é."]), max_size=2), label="stops")
    stop_byte = data.draw(st.none() | st.sampled_from(script), label="stop_byte")
    engine.reset()  # a fresh scheduler: request ids are new again
    engine.runner.scripts["s"] = script
    params = {"n": n, "max_tokens": len(script) + 3, "min_tokens": min(min_tokens, len(script)), "stop": stops,
              "include_stop_str_in_output": include, "ignore_eos": True,
              "stop_token_ids": [] if stop_byte is None else [stop_byte]}
    for kind in KINDS:
        engine.add_request(f"s/{kind}", [1, 2, 3], SamplingParams(temperature=0, output_kind=kind, **params))
    outs: dict[str, list] = {kind: [] for kind in KINDS}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id.split("/")[1]].append(out)
    final = outs["final_only"]
    assert len(final) == 1 and final[0].finished
    assert [c.index for c in final[0].outputs] == list(range(n))
    for want in final[0].outputs:
        _check_sample(want, [o for out in outs["cumulative"] for o in out.outputs if o.index == want.index],
                      [o for out in outs["delta"] for o in out.outputs if o.index == want.index], include)
    for kind in ("cumulative", "delta"):
        assert [o.finished for o in outs[kind]] == [False] * (len(outs[kind]) - 1) + [True]


def _check_sample(want, cumulative, deltas, include):
    for o in cumulative:
        assert want.text.startswith(o.text)
        assert want.token_ids[:len(o.token_ids)] == o.token_ids
    last = cumulative[-1]
    assert (last.text, last.token_ids, last.finish_reason, last.stop_reason) == \
        (want.text, want.token_ids, want.finish_reason, want.stop_reason)
    assert "".join(c.text for c in deltas) == want.text
    assert [t for c in deltas for t in c.token_ids] == want.token_ids
    assert deltas[-1].finish_reason == want.finish_reason
    # The rules themselves, on the bytes: a stop string is cut with what follows (kept with
    # include_stop_str_in_output); a stop token's text is dropped (kept likewise).
    decode = byte_tokenizer().decode
    if want.finish_reason == "stop" and isinstance(want.stop_reason, str):
        stop = want.stop_reason
        assert want.text.endswith(stop) if include else decode(want.token_ids).startswith(want.text + stop)
    elif want.finish_reason == "stop":
        assert want.stop_reason == want.token_ids[-1]
        assert want.text == decode(want.token_ids if include else want.token_ids[:-1])
    else:
        assert want.finish_reason == "length" and want.text == decode(want.token_ids)
