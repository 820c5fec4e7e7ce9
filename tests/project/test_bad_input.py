"""Bad input at every Python entry point, table-driven: each row is one bad input to one entry
point and the words its error must hold (the field; the prompt's index where a call takes several),
and each entry point's runner checks that the other requests of the same call are unharmed.

Entry points here: `SamplingParams`, `LLM(...)`, `LLM.generate`, `LLMEngine.add_request`, and a
user's script run as `python script.py` (a mistake in how it starts an engine).
`experiments.run` (configs, traces) has its rows in test_bad_input_run.py, the HTTP server in
test_serving_http.py (`BAD_REQUESTS`: status and the field named, then a good request served), the
server's command line in test_serving_faults.py (`CLI_ERRORS`: one line, exit code 2). A
new entry point adds a table and a runner of the same shape: `(id, bad input, match)` rows, a
runner that submits the bad input among good ones and checks the good ones' outcome.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from engine_helpers import save_tiny_model
from process_helpers import gone

from engine.engine_args import EngineArgs
from engine.offline.llm import LLM
from engine.offline.llm_engine import LLMEngine
from policies.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
MAX_MODEL_LEN = 64
VOCAB = 256  # tiny-llama's
SMALL = {"num_gpu_blocks": 64, "swap_space": 0, "max_model_len": MAX_MODEL_LEN}


def rows(*table):
    return pytest.mark.parametrize(("bad", "match"), [r[1:] for r in table], ids=[r[0] for r in table])


# ---- SamplingParams(...) ------------------------------------------------------------------------
SAMPLING = (
    ("n-zero", {"n": 0}, r"n=0 is invalid"),
    ("n-float", {"n": 1.5}, r"n=1.5 is invalid"),
    ("temperature-negative", {"temperature": -1}, r"temperature=-1 is invalid"),
    ("temperature-nan", {"temperature": math.nan}, r"temperature=nan is invalid"),
    ("temperature-inf", {"temperature": math.inf}, r"temperature=inf is invalid"),
    ("temperature-text", {"temperature": "hot"}, r"temperature='hot' is invalid"),
    ("top_p-over-one", {"top_p": 1.5}, r"top_p=1.5 is invalid: must be in \(0, 1\]"),
    ("top_p-zero", {"top_p": 0}, r"top_p=0 is invalid"),
    ("top_p-nan", {"top_p": math.nan}, r"top_p=nan is invalid"),
    ("top_k", {"top_k": -2}, r"top_k=-2 is invalid"),
    ("min_p", {"min_p": 2}, r"min_p=2 is invalid"),
    ("seed", {"seed": "x"}, r"seed='x' is invalid"),
    ("max_tokens-zero", {"max_tokens": 0}, r"max_tokens=0 is invalid"),
    ("min_tokens-over-max", {"max_tokens": 4, "min_tokens": 9}, r"min_tokens=9 is invalid.*max_tokens=4"),
    ("stop_token_ids", {"stop_token_ids": [-1]}, r"stop_token_ids=\[-1\] is invalid"),
    ("stop-empty", {"stop": [""]}, r"stop=\[''\] is invalid"),
    ("logprobs", {"logprobs": -1}, r"logprobs=-1 is invalid"),
)


@rows(*SAMPLING)
def test_sampling_params(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_tiny_temperatures_sample_as_greedy(llm):
    """1e-45 divides every logit into inf (garbage tokens); below 1e-5 vLLM samples greedily."""
    assert SamplingParams(temperature=1e-45).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    prompts = [[5, 6, 7], [9, 8, 7, 6]]
    tiny = [SamplingParams(temperature=t, max_tokens=6, ignore_eos=True) for t in (1e-45, 1e-30)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for params in tiny:
        out = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in greedy]


# ---- LLM(...) -----------------------------------------------------------------------------------
def _truncated_weights(tmp_path):
    path = tmp_path / "truncated"
    save_tiny_model(path, "llama", with_tokenizer=False)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    return str(path), {"num_gpu_blocks": 16}


def _no_weights(tmp_path):
    path = tmp_path / "no-weights"
    save_tiny_model(path, "llama", with_tokenizer=False)
    (path / "model.safetensors").unlink()
    return str(path), {"num_gpu_blocks": 16}


CONSTRUCTOR = (
    ("unknown-model", ("no-such-model", {}), r"model='no-such-model' is unknown"),
    ("unknown-argument", ("tiny-llama", {"no_such_arg": 1}), r"\['no_such_arg'\] are unknown"),
    ("block_manager", ("tiny-llama", {"block_manager": "lru"}), r"block_manager='lru' is invalid"),
    ("preemption_mode", ("tiny-llama", {"preemption_mode": "drop"}), r"preemption_mode='drop' is invalid"),
    ("policy", ("tiny-llama", {"policy": "lottery"}), r"lottery"),
    ("max_num_seqs", ("tiny-llama", {"max_num_seqs": 0}), r"max_num_seqs=0 is invalid"),
    ("max_num_batched_tokens", ("tiny-llama", {"max_num_batched_tokens": -5}),
     r"max_num_batched_tokens=-5 is invalid"),
    ("max_model_len-too-small", ("tiny-llama", {"max_model_len": 1}), r"max_model_len=1 is invalid"),
    ("max_model_len-over-model", ("tiny-llama", {"max_model_len": 4096}), r"max_model_len=4096 is invalid"),
    ("device", ("tiny-llama", {"device": "tpu"}), r"device='tpu' is invalid"),
    ("block_size", ("tiny-llama", {"block_size": 3}), r"block_size=3 is invalid"),
    ("gpu_memory_utilization", ("tiny-llama", {"gpu_memory_utilization": 2}),
     r"gpu_memory_utilization=2 is invalid"),
    ("swap_space", ("tiny-llama", {"swap_space": -1}), r"swap_space=-1 is invalid"),
    ("num_gpu_blocks-zero", ("tiny-llama", {"num_gpu_blocks": 0}), r"num_gpu_blocks=0 is invalid"),
    ("kv-cache-too-small", ("tiny-llama", {"num_gpu_blocks": 4, "max_model_len": 256}),
     r"num_gpu_blocks=4 is invalid: .* max_model_len=256 sequence, which takes 16 of them: set it to at least 16"),
    ("decode_kernel", ("tiny-llama", {"decode_kernel": "flash"}), r"decode_kernel='flash' is invalid"),
    ("max_logprobs", ("tiny-llama", {"max_logprobs": -2}), r"max_logprobs=-2 is invalid"),
    ("num_gpu_blocks-negative", ("tiny-llama", {"num_gpu_blocks": -3}), r"num_gpu_blocks=-3 is invalid"),
    ("custom_all_reduce_max_bytes", ("tiny-llama", {"custom_all_reduce_max_bytes": 1000}),
     r"custom_all_reduce_max_bytes=1000 is invalid"),
    ("sequence_parallel_min_rows", ("tiny-llama", {"sequence_parallel_min_rows": -1}),
     r"sequence_parallel_min_rows=-1 is invalid: an integer >= 0"),
    ("model-not-a-model", ("/etc/passwd", {}), r"model='/etc/passwd' is unknown"),
    ("missing-safetensors", (_no_weights, {}), r"missing file .*model\.safetensors"),
    ("truncated-safetensors", (_truncated_weights, {}), r"weights file '.*model\.safetensors' is invalid"),
)


@rows(*CONSTRUCTOR)
def test_llm_constructor(bad, match, tmp_path):
    model, kwargs = bad
    if callable(model):
        model, extra = model(tmp_path)
        kwargs = extra | kwargs
    with pytest.raises(ValueError, match=match):
        LLM(model, **{"swap_space": 0} | kwargs)


def test_first_call_on_a_cpu_needs_no_kv_size():
    """No num_gpu_blocks on a CPU: a stated default size (engine/device/model_runner.py) instead of an error."""
    out = LLM("tiny-llama", max_model_len=MAX_MODEL_LEN, swap_space=0).generate([1, 2, 3], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# ---- LLM.generate ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **SMALL)


GOOD = [[1, 2, 3], [7, 8, 9, 10]]
GENERATE = (  # `bad` is the whole prompts argument, or (good prompts around it, bad prompt at index 1)
    ("int", 123, r"prompts=123 is invalid"),
    ("none", None, r"prompts=None is invalid"),
    ("bytes", b"abc", r"prompts=b'abc' is invalid"),
    ("empty-list", [], r"prompts=\[\] is invalid"),
    ("int-among-good", ("among", 123), r"prompts\[1\]=123 is invalid"),
    ("empty-prompt", ("among", []), r"prompts\[1\]=\[\] is invalid"),
    ("bytes-among-good", ("among", b"abc"), r"prompts\[1\]=b'abc' is invalid"),
    ("too-long", ("among", [1] * (MAX_MODEL_LEN + 1)), r"prompts\[1\]: .*max_model_len=64"),
    ("out-of-vocabulary", ("among", [3, VOCAB, 999]), r"prompts\[1\]: prompt_token_ids=\[256, 999\]"),
    ("negative-id", ("among", [3, -1]), r"prompts\[1\]: prompt_token_ids=\[-1\]"),
    ("dict-unknown-key", ("among", {"text": "hi"}), r"prompts\[1\]=\{'text': 'hi'\} is invalid.*unknown"),
    ("dict-two-keys", ("among", {"prompt": "a", "prompt_token_ids": [1]}), r"prompts\[1\]=.*exactly one"),
    ("dict-empty-ids", ("among", {"prompt_token_ids": []}), r"prompts\[1\]\['prompt_token_ids'\]=\[\] is invalid"),
    ("dict-prompt-not-text", ("among", {"prompt": 5}), r"prompts\[1\]\['prompt'\]=5 is invalid"),
    ("text-without-tokenizer", ("among", "hello"), r"prompts\[1\]: .*has no tokenizer"),
)


@rows(*GENERATE)
def test_generate(llm, bad, match):
    """Rejected before any work (as vLLM): nothing of the call stays queued or runs, and the same
    good prompts then give the outputs they give alone."""
    before = llm.generate(GOOD, GREEDY, use_tqdm=False)
    prompts = [GOOD[0], bad[1], GOOD[1]] if isinstance(bad, tuple) else bad
    num_requests = len(llm.engine.recorder.requests)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    withdrawn = llm.engine.recorder.requests[num_requests:]
    assert all(r["status"] == "aborted" and r["output_len"] == 0 and r["first_scheduled_time"] is None
               for r in withdrawn)
    after = llm.generate(GOOD, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


@pytest.mark.parametrize(("params", "match"), [
    ([GREEDY], r"sampling_params has 1 entries"),
    ([GREEDY, SamplingParams(max_tokens=2), "greedy"], r"prompts\[2\]: sampling_params='greedy' is invalid"),
], ids=["too-few", "not-a-SamplingParams"])
def test_generate_sampling_params(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([*GOOD, [4, 5]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---- LLMEngine.add_request -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineArgs(model="tiny-llama", max_num_seqs=4, **SMALL))


ADD_REQUEST = (  # keyword arguments of add_request that replace the good request's
    ("prompt-int", {"prompt": 123}, r"prompt=123 is invalid"),
    ("prompt-none", {"prompt": None}, r"prompt=None is invalid"),
    ("prompt-bytes", {"prompt": b"abc"}, r"prompt=b'abc' is invalid"),
    ("prompt-empty", {"prompt": []}, r"prompt_token_ids=\[\] is invalid"),
    ("prompt-too-long", {"prompt": [1] * (MAX_MODEL_LEN + 1)}, r"longer than max_model_len=64"),
    ("prompt-out-of-vocabulary", {"prompt": [1, VOCAB]}, r"prompt_token_ids=\[256\] is invalid"),
    ("prompt-bool-ids", {"prompt": [True, 2]}, r"prompt_token_ids=\[True\] is invalid"),
    ("text-without-tokenizer", {"prompt": "hi"}, r"has no tokenizer"),
    ("request_id-empty", {"request_id": ""}, r"request_id='' is invalid"),
    ("request_id-not-text", {"request_id": 7}, r"request_id=7 is invalid"),
    ("request_id-duplicate", {"request_id": "good-0"}, r"request_id='good-0' is invalid: already added"),
    ("sampling_params-type", {"sampling_params": {"temperature": 0}}, r"sampling_params=.* is invalid"),
    ("n-over-max_num_seqs", {"sampling_params": SamplingParams(n=5)}, r"n=5 is invalid.*max_num_seqs=4"),
    ("stop-without-tokenizer", {"sampling_params": SamplingParams(stop=["x"])}, r"stop=\['x'\] is invalid"),
    ("logprobs-over-max_logprobs", {"sampling_params": SamplingParams(logprobs=21)},
     r"logprobs=21 is invalid: at most max_logprobs=20"),
    ("logprobs-over-vocabulary", {"sampling_params": SamplingParams(logprobs=VOCAB + 1)},
     r"logprobs=257 is invalid"),
    ("priority", {"priority": "high"}, r"priority='high' is invalid"),
    ("arrival_time", {"arrival_time": -1.0}, r"arrival_time=-1.0 is invalid"),
    ("output_len", {"output_len": 0}, r"output_len=0 is invalid"),
)


@rows(*ADD_REQUEST)
def test_add_request(engine, bad, match):
    """The bad request is refused and nothing else changes: the good ones around it finish."""
    engine.reset()
    engine.add_request("good-0", [1, 2, 3], GREEDY)
    request = {"request_id": "bad", "prompt": [4, 5, 6], "sampling_params": GREEDY} | bad
    with pytest.raises(ValueError, match=match):
        engine.add_request(**request)
    engine.add_request("good-1", [7, 8], GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert {o.request_id: o.outputs[0].finish_reason for o in outputs} == {"good-0": "length", "good-1": "length"}
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)


def test_abort_of_unknown_ids_is_false(engine):
    engine.reset()
    assert engine.abort_request("nope") is False
    assert engine.abort_request(None) is False
    assert not engine.has_unfinished_requests()


# ---- a user's script: python script.py ---------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
SCRIPT_BOUND_S = 120  # two interpreters import torch on a busy machine; the fault itself is seen in < 1 s
TP_ENGINE = ("from engine.engine_args import EngineArgs\nfrom engine.offline.llm_engine import LLMEngine\n\n"
             "engine = LLMEngine(EngineArgs(model='tiny-llama', num_gpu_blocks=64, max_model_len=128, "
             "tensor_parallel_size=2))\nprint('started')\n")
SCRIPTS = (  # the script's text -> words of the error it must end with, within SCRIPT_BOUND_S
    ("tensor-parallel-without-main-guard", TP_ENGINE,
     r"WorkerFailure: tensor-parallel worker 1 \(pid \d+\) exited during start-up with exit code 87: .*"
     r"under `if __name__ == \"__main__\":`"),
)


@rows(*SCRIPTS)
def test_script(bad, match, tmp_path):
    """The script fails fast with the fix in its last line, and leaves no worker behind."""
    script = tmp_path / "script.py"
    script.write_text(bad)
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=SCRIPT_BOUND_S, check=False,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert res.returncode != 0 and "started" not in res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert re.search(match, last), res.stderr[-3000:]
    assert all(gone(int(pid)) for pid in re.findall(r"pid (\d+)", last))
