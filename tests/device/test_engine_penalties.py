"""Presence, frequency and repetition penalties (vLLM's definitions) in the engine's sampler: the
penalized logits against a hand computation, greedy decoding with repetition_penalty against
transformers' `generate`, and all three against a step-by-step hand loop over transformers' logits,
in both scheduling modes."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import ragged_prompts, save_tiny_model

from engine.device.sampler import Sampler, apply_penalties
from engine.offline.llm import LLM
from policies.outputs import ScheduledSeq
from policies.request import Request, SamplingParams
from policies.sequence import Sequence

V = 20


def _seq(seq_id: int, prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence.from_request(seq_id, Request(f"r{seq_id}", prompt, params))
    seq.token_ids.extend(output)
    return seq


def _by_hand(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    out = []
    for t, x in enumerate(logits):
        if t in prompt or t in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * output.count(t) + p.presence_penalty * (t in output)
        out.append(x)
    return out


def test_penalized_logits_match_a_hand_computation():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 3
    rows = [
        ([1, 2, 3], [4, 4, 5, 1], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)),
        ([7, 7], [], SamplingParams(repetition_penalty=1.5)),  # a prompt's first token: no output yet
        ([0, 9], [9, 9, 2, 3], SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=0.8)),
    ]
    seqs = [_seq(i, prompt, output, p) for i, (prompt, output, p) in enumerate(rows)]
    got = apply_penalties(logits, seqs, [p for _, _, p in rows], [0, 1, 2])
    for i, (prompt, output, p) in enumerate(rows):
        assert got[i].tolist() == pytest.approx(_by_hand(logits[i].tolist(), prompt, output, p), rel=1e-6)
    assert torch.equal(apply_penalties(logits, seqs[:1], [rows[0][2]], [1])[[0, 2]], logits[[0, 2]])


def test_greedy_rows_with_penalties_take_the_penalized_argmax():
    logits = torch.zeros(2, V)
    logits[:, 4] = 2.0  # the best token, repeated in both outputs
    logits[:, 6] = 1.5
    params = [SamplingParams(temperature=0, frequency_penalty=0.2), SamplingParams(temperature=0, presence_penalty=0.6)]
    seqs = [_seq(0, [1], [4, 4, 4], params[0]), _seq(1, [1], [4], params[1])]
    sched = [ScheduledSeq(seq, 1, 1) for seq in seqs]
    assert Sampler.fast_temperatures(sched) is None  # penalties need the full sampler
    tokens = [r.token_ids for r in Sampler(torch.device("cpu"))(logits, sched)]
    assert tokens == [[6], [6]]  # 2 - 3 * 0.2 = 1.4 < 1.5; 2 - 0.6 = 1.4 < 1.5
    assert Sampler(torch.device("cpu"))(logits, [ScheduledSeq(_seq(2, [1], [4], SamplingParams(temperature=0)), 1, 1)])[0].token_ids == [4]


@pytest.mark.parametrize("bad", [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                                 {"presence_penalty": float("nan")}, {"repetition_penalty": True},
                                 {"include_stop_str_in_output": 1}, {"skip_special_tokens": "no"},
                                 {"output_kind": "stream"}], ids=str)
def test_bad_values_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("pen") / "llama"
    model = save_tiny_model(path, "llama", seed=7)
    return str(path), model


PROMPTS = ragged_prompts(4, seed=21, min_len=4, max_len=30)
STEPS = 24


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_repetition_penalty_matches_transformers(tiny, ahead):
    path, hf = tiny
    llm = LLM(path, num_gpu_blocks=128, swap_space=0.01, max_model_len=256, async_scheduling=ahead)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, repetition_penalty=1.3)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                              min_new_tokens=STEPS, do_sample=False, repetition_penalty=1.3, pad_token_id=0)
            want.append(out[0, len(prompt):].tolist())
    assert got == want
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != got  # the penalty changed something


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_all_penalties_match_a_hand_loop_over_transformers_logits(tiny, ahead):
    path, hf = tiny
    llm = LLM(path, num_gpu_blocks=128, swap_space=0.01, max_model_len=256, async_scheduling=ahead)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, presence_penalty=0.4,
                            frequency_penalty=0.3, repetition_penalty=1.1)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, tokens in zip(PROMPTS, got):
        output: list[int] = []
        with torch.no_grad():
            for _ in range(STEPS):
                logits = hf(torch.tensor([prompt + output])).logits[0, -1].float().tolist()
                penalized = _by_hand(logits, prompt, output, params)
                output.append(max(range(len(penalized)), key=penalized.__getitem__))
        assert tokens == output


@pytest.mark.gpu
def test_penalties_on_the_gpu_sampler_match_the_cpu(tiny):
    """The sampler's penalties on CUDA (bf16 logits, as the engine's) equal the CPU's, and a tiny model
    decoded greedily on the GPU with all three penalties gives the CPU engine's tokens, with CUDA
    graphs and async scheduling (penalized steps run synchronously there).
        python -m pytest -q -m gpu tests/device/test_engine_penalties.py"""
    logits = (torch.randn(2, 300, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    params = [SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, repetition_penalty=0.7)]
    seqs = [_seq(0, [1, 2, 3], [4, 4, 250], params[0]), _seq(1, [5], [5, 6], params[1])]
    cpu = apply_penalties(logits.float(), seqs, params, [0, 1])
    gpu = apply_penalties(logits.cuda().float(), seqs, params, [0, 1])
    torch.testing.assert_close(gpu.cpu(), cpu)
    sched = [ScheduledSeq(seq, 1, 1) for seq in seqs]
    assert Sampler(torch.device("cuda"))(logits.cuda(), sched)[0].token_ids == [int(cpu[0].argmax())]
    path, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, presence_penalty=0.4,
                            frequency_penalty=0.3, repetition_penalty=1.1)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(path, device=device, dtype="float32", num_gpu_blocks=128, swap_space=0.01, max_model_len=256,
                  async_scheduling=True)
        outs[device] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert outs["cuda"] == outs["cpu"]
