"""The engine's user-facing API on CPU: add / abort / step, `LLM.generate` with text and token ids,
stop strings, min_tokens, logprobs, and clear errors for bad input."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from engine_helpers import ragged_prompts, save_tiny_model, scheduling

from engine.engine_args import EngineArgs
from engine.offline.llm import LLM
from engine.offline.llm_engine import LLMEngine
from policies.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "qwen3"
    model = save_tiny_model(path, "qwen3", seed=3)
    return str(path), model


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "default"])
def llm(tiny, request):
    return LLM(tiny[0], num_gpu_blocks=128, swap_space=0.01, max_model_len=256, **scheduling(request.param))


def test_a_dropped_engine_is_freed_without_the_cyclic_collector(tiny):
    """LLMEngine freezes the GC heap at start-up (as vLLM), so the collector never looks at an
    engine again: its model and KV cache must go by reference counting alone, or every engine
    made and dropped in a process (sweeps, notebooks) would keep its memory."""
    import gc
    import weakref
    engine = LLMEngine(EngineArgs(model=tiny[0], num_gpu_blocks=64, swap_space=0.01, max_model_len=256))
    engine.add_request("r", [1, 2, 3], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    refs = [weakref.ref(x) for x in (engine, engine.runner, engine.runner.model, engine.runner.kv_cache, engine.scheduler)]
    collecting = gc.isenabled()
    gc.disable()
    try:
        del engine
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "default"])
def test_add_step_abort(tiny, ahead):
    engine = LLMEngine(EngineArgs(model=tiny[0], num_gpu_blocks=128, swap_space=0.01, max_model_len=256,
                                  **scheduling(ahead)))
    for i, prompt in enumerate(ragged_prompts(3, seed=2)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("r0", [1, 2, 3], GREEDY)
    first = engine.step()  # the prefill samples each request's first token: progress, nothing ends
    assert sorted(o.request_id for o in first) == ["r0", "r1", "r2"]
    assert all(not o.finished and len(o.outputs[0].token_ids) == 1 for o in first)
    assert engine.abort_request("r1") is True
    assert engine.abort_request("r1") is False  # already aborted
    assert engine.abort_request("nope") is False
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    by_id = {o.request_id: o for o in outputs}
    assert sorted(by_id) == ["r0", "r1", "r2"]
    assert by_id["r1"].finished and by_id["r1"].outputs[0].finish_reason == "abort:user"
    assert len(by_id["r1"].outputs[0].token_ids) == 1
    for rid in ("r0", "r2"):
        out = by_id[rid]
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 8
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert out.tpot is not None and out.tpot > 0
    assert engine.recorder.requests[-1]["status"] in ("finished", "aborted")
    assert engine.abort_request("r0") is False  # finished
    assert (engine.scheduler.num_scheduled_ahead > 0) is ahead


def test_generate_text_and_token_ids(llm):
    text_out = llm.generate(["Hello", "ab"], GREEDY, use_tqdm=False)
    ids_out = llm.generate([[72, 101, 108, 108, 111], [97, 98]], GREEDY, use_tqdm=False)
    single = llm.generate([97, 98], GREEDY, use_tqdm=True)  # one prompt given as token ids
    assert [o.prompt for o in text_out] == ["Hello", "ab"]
    assert [o.prompt_token_ids for o in text_out] == [[72, 101, 108, 108, 111], [97, 98]]
    assert [o.outputs[0].token_ids for o in text_out] == [o.outputs[0].token_ids for o in ids_out]
    assert single[0].outputs[0].token_ids == ids_out[1].outputs[0].token_ids
    tokens = text_out[0].outputs[0].token_ids
    assert text_out[0].outputs[0].text == llm.tokenizer.decode(tokens)


def test_generate_vllm_dict_prompts(llm):
    """vLLM's TextPrompt / TokensPrompt dicts, alone or in a list, are the prompts they hold."""
    ids, text = [72, 101, 108, 108, 111], "Hello"
    plain = llm.generate([ids, text], GREEDY, use_tqdm=False)
    one_ids = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    one_text = llm.generate({"prompt": text}, GREEDY, use_tqdm=False)
    listed = llm.generate([{"prompt_token_ids": ids}, {"prompt": text}], GREEDY, use_tqdm=False)
    for got in (one_ids + one_text, listed):
        assert [o.prompt_token_ids for o in got] == [ids, ids]
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert one_text[0].prompt == text and one_ids[0].prompt is None


def test_generate_keeps_input_order(llm):
    prompts = ragged_prompts(5, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (9, 1, 5, 3, 7)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [9, 1, 5, 3, 7]


def test_stop_string_truncates_text(llm):
    prompt = [ord(c) for c in "The quick brown fox"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    full = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    # A two-character stop string taken from the middle of the greedy text.
    at = next(i for i in range(3, len(full.text) - 1) if full.text[i:i + 2].isascii()
              and full.text[i:i + 2].isprintable() and full.text.find(full.text[i:i + 2]) == i)
    stop = full.text[at:at + 2]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:at]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    assert stop in llm.tokenizer.decode(out.token_ids)  # the token that completed it is kept


def test_stop_string_on_the_first_token_of_a_forked_sample(llm):
    """n > 1: sample i > 0 is forked in the step that sampled its first token; a stop string that
    token completes ends it right there (one token, empty text), not one token later."""
    prompt = [ord(c) for c in "The quick brown fox"]
    base = SamplingParams(temperature=1.0, seed=7, n=8, max_tokens=6, ignore_eos=True)
    free = {o.index: o for o in llm.generate(prompt, base, use_tqdm=False)[0].outputs}
    pick = next(o for i, o in sorted(free.items())
                if i > 0 and o.text[:1].isascii() and o.text[:1].isprintable() and o.text[:1].strip()
                and llm.tokenizer.decode(o.token_ids[:1]) == o.text[:1])
    stop = pick.text[0]
    outs = {o.index: o for o in llm.generate(prompt, dataclasses.replace(base, stop=[stop]),
                                             use_tqdm=False)[0].outputs}
    got = outs[pick.index]
    assert got.token_ids == pick.token_ids[:1] and got.text == ""
    assert got.finish_reason == "stop" and got.stop_reason == stop
    for i, o in outs.items():  # every sample's tokens are a prefix of its unstopped run
        assert o.token_ids == free[i].token_ids[:len(o.token_ids)]


def test_stop_token_ids_and_min_tokens(llm):
    prompt = ragged_prompts(1, seed=5)[0]
    full = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[1]
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == full[:full.index(stop_id) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    # vLLM: the stop token's text is left out of the text, unless include_stop_str_in_output.
    assert stopped.text == llm.tokenizer.decode(stopped.token_ids[:-1])
    kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == stopped.token_ids and kept.text == llm.tokenizer.decode(kept.token_ids)
    assert kept.text != stopped.text
    held = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, min_tokens=6,
                                               stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 6 and stop_id not in held.token_ids[:6]


def test_logprobs_match_transformers(llm, tiny):
    prompt = ragged_prompts(1, seed=6)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    with torch.no_grad():
        logits = tiny[1](torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for pos, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        top3 = ref[pos].topk(3).indices.tolist()
        assert token in lp and set(top3) <= set(lp) and len(lp) <= 4
        for tid, value in lp.items():
            assert value == pytest.approx(ref[pos, tid].item(), abs=1e-4)
        assert lp[token] == max(lp.values())  # greedy picks the most likely token


def test_bad_input_errors(tiny, llm, tmp_path):
    with pytest.raises(ValueError, match="model='no-such-model' is unknown"):
        LLM("no-such-model")
    empty = tmp_path / "no-weights"
    save_tiny_model(empty, "llama", with_tokenizer=False)
    for f in empty.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(empty), num_gpu_blocks=16, swap_space=0.01)
    gelu = tmp_path / "gelu"
    save_tiny_model(gelu, "llama", with_tokenizer=False)
    config = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps(config | {"hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        LLM(str(gelu), num_gpu_blocks=16, swap_space=0.01)
    with pytest.raises(ValueError, match=r"num_gpu_blocks=4 is invalid: .* which takes 16 of them"):
        LLM(tiny[0], num_gpu_blocks=4, swap_space=0.01, max_model_len=256, block_size=16)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt_token_ids=\[256, 999\].*\[0, 256\)"):
        llm.generate([[1, 2], [3, 256, 999]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the valid first prompt was withdrawn too
    with pytest.raises(ValueError, match="temperature=-1"):
        llm.generate([1, 2], SamplingParams(temperature=-1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"top_p=1.5 is invalid: must be in \(0, 1\]"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="min_tokens=9"):
        SamplingParams(max_tokens=4, min_tokens=9)
    with pytest.raises(ValueError, match="max_model_len=256"):
        llm.generate([[1] * 300], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 1 entries"):
        llm.generate([[1], [2]], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="block_manager='lru'"):
        LLM(tiny[0], num_gpu_blocks=16, swap_space=0.01, block_manager="lru")
    with pytest.raises(ValueError, match="unknown"):
        LLM(tiny[0], num_gpu_blocks=16, swap_space=0.01, no_such_arg=1)


def test_dummy_model_without_tokenizer():
    llm = LLM("tiny-llama", num_gpu_blocks=32, swap_space=0.01, max_model_len=128)
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([1, 2], SamplingParams(stop=["x"]), use_tqdm=False)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "default"])
def test_forced_output_lengths(tiny, ahead):
    """add_request(output_len=...) ends a sample after that many tokens with "stop"; scheduled ahead,
    the length is applied when the step is looked past, not one token late."""
    engine = LLMEngine(EngineArgs(model=tiny[0], num_gpu_blocks=128, swap_space=0.01, max_model_len=256,
                                  **scheduling(ahead)))
    lens = [1, 2, 5, 9]
    for i, (prompt, n) in enumerate(zip(ragged_prompts(4, seed=9), lens)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                           output_len=n)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    by_id = {o.request_id: o.outputs[0] for o in outputs}
    assert [len(by_id[f"r{i}"].token_ids) for i in range(4)] == lens
    assert all(c.finish_reason == "stop" for c in by_id.values())
    assert (engine.scheduler.num_scheduled_ahead > 0) is ahead


def test_detokenizer_fast_decode_equals_the_tokenizers(tiny):
    """The detokenizer calls a fast tokenizer's Rust backend directly when the tokenizer cleans up
    nothing (and the tokenizer's own decode otherwise): the text is the same either way."""
    from engine.offline.detokenizer import Detokenizer
    from engine.offline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny[0])
    ids = ragged_prompts(1, seed=9, min_len=80, max_len=80)[0]
    texts = {}
    for clean in (False, True):
        tokenizer.clean_up_tokenization_spaces = clean
        detok = Detokenizer(tokenizer)
        assert (detok._decode == tokenizer._tokenizer.decode) is not clean
        state = detok.new_state(10)
        for end in range(11, len(ids) + 1):
            detok.update(state, ids[:end])
        detok.update(state, ids, final=True)
        texts[clean] = state.text
        assert state.text == detok.decode_output(ids, 10)
    assert texts[False] == tokenizer.decode(ids[10:]) == texts[True]


def test_tenant_reaches_the_trace():
    """LLM.generate(tenant=) and add_request(tenant=) put the client's id on the request and its trace
    row; a bad one is refused naming the field."""
    llm = LLM("tiny-llama", num_gpu_blocks=32, swap_space=0.01, max_model_len=128)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False, tenant="acme")
    llm.engine.add_request("solo", [3, 4], SamplingParams(temperature=0.0, max_tokens=2))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    tenants = {row["request_id"]: row["tenant"] for row in llm.engine.recorder.requests}
    assert tenants == {"llm-0": "acme", "llm-1": "acme", "solo": None}
    with pytest.raises(ValueError, match="tenant=''"):
        llm.generate([1, 2], use_tqdm=False, tenant="")
