"""Sampler: greedy, seeded reproducibility, top-k / top-p / min-p masks, n samples, min_tokens,
logprobs. Logits are hand-made; sequences come from policies' Request/Sequence."""
import math

import pytest
import torch

from engine.device.sampler import Sampler, _top_k_top_p
from policies.outputs import ScheduledSeq
from policies.request import Request, SamplingParams
from policies.sequence import Sequence

V = 50


def sched(params: list[SamplingParams], samples: list[int] | None = None, eos: int | None = None,
          start_id: int = 0) -> list[ScheduledSeq]:
    samples = samples or [1] * len(params)
    return [ScheduledSeq(Sequence.from_request(start_id + i, Request(f"r{i}", [1, 2, 3], p, eos_token_id=eos)),
                         1, n) for i, (p, n) in enumerate(zip(params, samples))]


def rand_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_repeats_for_n():
    logits = rand_logits(4)
    res = Sampler(torch.device("cpu"))(logits, sched([SamplingParams(temperature=0)] * 4, [1, 3, 1, 2]))
    argmax = logits.argmax(-1).tolist()
    assert [r.token_ids for r in res] == [[argmax[0]], [argmax[1]] * 3, [argmax[2]], [argmax[3]] * 2]
    assert all(r.logprobs is None for r in res)


def test_seeded_sampling_reproducible_and_batch_independent():
    logits = rand_logits(3, seed=1) / 3
    p = SamplingParams(temperature=1.0, seed=1234)
    a = Sampler(torch.device("cpu"))(logits[:1], sched([p], [4]))[0].token_ids
    # same request inside another batch, next to unseeded and greedy rows, on a fresh sampler
    other = [SamplingParams(temperature=0.7), p, SamplingParams(temperature=0)]
    b = Sampler(torch.device("cpu"))(logits[[1, 0, 2]], sched(other, [2, 4, 1]))[1].token_ids
    assert a == b
    assert len(set(a)) > 1  # 4 draws of a T=1 distribution over 50 tokens are not all equal
    different_seed = Sampler(torch.device("cpu"))(logits[:1], sched([SamplingParams(seed=99)], [4]))[0]
    assert different_seed.token_ids != a


def test_seeded_generator_advances_per_step_and_is_released():
    s = Sampler(torch.device("cpu"))
    seqs = sched([SamplingParams(seed=7)])
    logits = torch.zeros(1, V)  # uniform: every draw is the generator's
    draws = [s(logits, seqs)[0].token_ids[0] for _ in range(6)]
    assert len(set(draws)) > 1
    s.release([0])
    assert s.generators == {}
    again = [s(logits, seqs)[0].token_ids[0] for _ in range(6)]
    assert again == draws


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)])
    res = Sampler(torch.device("cpu"))(logits, sched([SamplingParams(temperature=1.0, seed=0)], [4000]))
    counts = torch.bincount(torch.tensor(res[0].token_ids), minlength=V).float() / 4000
    torch.testing.assert_close(counts[:4], torch.softmax(logits[0], -1)[:4], atol=0.03, rtol=0)


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p"])
def test_masks_keep_only_allowed_tokens(kind):
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0] + [-2.0] * (V - 4)])
    probs = torch.softmax(logits[0], -1)
    if kind == "top_k":
        params, allowed = SamplingParams(top_k=2, seed=0), {0, 1}
    elif kind == "top_p":  # the smallest set with mass >= 0.9
        need = int((probs.cumsum(0) < 0.9).sum()) + 1
        params, allowed = SamplingParams(top_p=0.9, seed=0), set(range(need))
    else:
        params, allowed = SamplingParams(min_p=0.2, seed=0), {i for i in range(V) if probs[i] >= 0.2 * probs[0]}
    res = Sampler(torch.device("cpu"))(logits, sched([params], [500]))[0].token_ids
    assert set(res) == allowed


def test_top_k_top_p_per_row_vectorised():
    logits = rand_logits(3, seed=3)
    out = _top_k_top_p(logits, torch.tensor([1, V, 3]), torch.tensor([1.0, 1e-6, 1.0]))
    kept = torch.isfinite(out).sum(-1).tolist()
    assert kept == [1, 1, 3]
    assert out[1].argmax() == logits[1].argmax()
    top3 = logits[2].topk(3).indices
    assert torch.equal(out[2][top3], logits[2][top3])


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.full((2, V), -5.0)
    logits[:, 7] = 10.0  # eos
    logits[:, 9] = 9.0  # a stop id
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9])
    seqs = sched([params, params], eos=7)
    seqs[1].seq.token_ids += [11, 12]  # already 2 output tokens: no mask
    res = Sampler(torch.device("cpu"))(logits, seqs)
    assert res[0].token_ids[0] not in (7, 9)
    assert res[1].token_ids == [7]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert Sampler(torch.device("cpu"))(logits[:1], sched([ignore], eos=7))[0].token_ids == [7]


def test_logprobs_of_sampled_and_top_tokens():
    logits = rand_logits(2, seed=4)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]
    res = Sampler(torch.device("cpu"))(logits, sched(params, [2, 1]))
    lp = torch.log_softmax(logits, -1)
    top = lp[0].topk(3)
    assert len(res[0].logprobs) == 2 and res[1].logprobs is None
    d = res[0].logprobs[0]
    assert set(d) == set(top.indices.tolist())  # greedy: the sampled token is the top-1
    for t, v in d.items():
        assert math.isclose(v, lp[0, t].item(), rel_tol=1e-5)
    res = Sampler(torch.device("cpu"))(logits[:1], sched([SamplingParams(seed=3, logprobs=0)], [5]))
    for tok, d in zip(res[0].token_ids, res[0].logprobs):
        assert list(d) == [tok] and math.isclose(d[tok], lp[0, tok].item(), rel_tol=1e-5)


def test_child_sequences_use_their_own_generator():
    p = SamplingParams(seed=5)
    parent = sched([p])[0]
    child = ScheduledSeq(parent.seq.fork(1, sample_index=1), 1, 1)
    logits = torch.zeros(2, V)
    a = [Sampler(torch.device("cpu"))(logits, [parent, child])[i].token_ids for i in range(2)]
    s = Sampler(torch.device("cpu"))
    seq_a = [s(logits, [parent, child]) for _ in range(8)]
    assert [r[0].token_ids for r in seq_a] != [r[1].token_ids for r in seq_a]
    assert a[0] == seq_a[0][0].token_ids and a[1] == seq_a[0][1].token_ids


def test_fast_path_is_greedy_where_asked_and_reproducible_under_manual_seed():
    """Greedy rows equal the general path's tokens; tempered rows come from one Gumbel-max pass
    (its distribution: tests/kernel/test_kernels_sample.py) seeded from torch's generator."""
    from engine.device.sampler import sample_with_temperatures

    logits = rand_logits(5, seed=3)
    for temps in ([0.0] * 5, [0.7, 1.3, 0.7, 2.0, 1.0], [0.0, 0.7, 0.0, 1.3, 0.0]):
        rows = sched([SamplingParams(temperature=t) for t in temps])
        assert Sampler.fast_temperatures(rows) == temps
        general = [r.token_ids[0] for r in Sampler(torch.device("cpu"))(logits, rows)]
        draws = []
        for _ in range(2):
            torch.manual_seed(11)
            draws.append(sample_with_temperatures(logits, torch.tensor(temps), temps).tolist())
        assert draws[0] == draws[1]
        assert [d for d, t in zip(draws[0], temps) if t == 0] == [g for g, t in zip(general, temps) if t == 0]


@pytest.mark.parametrize("params, samples", [
    (SamplingParams(logprobs=1), 1), (SamplingParams(top_k=5), 1), (SamplingParams(top_p=0.9), 1),
    (SamplingParams(min_p=0.1), 1), (SamplingParams(seed=3), 1), (SamplingParams(temperature=0.5), 2),
    (SamplingParams(min_tokens=2, max_tokens=4), 1)])
def test_fast_path_declines_what_it_cannot_do(params, samples):
    rows = sched([SamplingParams(temperature=0), params], [1, samples])
    assert Sampler.fast_temperatures(rows) is None
