"""Output-length predictors: the oracle, the noisy oracle, the per-prompt-length-bucket estimate
fitted from a trace, and their error report."""
from __future__ import annotations

import pytest

from experiments.lib.predictors import build_predictor, prediction_error
from experiments.lib.workloads import build_workload
from policies.length_predictor import BucketPredictor, make_predictor
from policies.request import Request, SamplingParams


def request(rid: str, prompt_len: int, max_tokens: int = 100) -> Request:
    return Request(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens))


def test_bucket_fit_by_hand():
    # Buckets at powers of two: [0, 2), [2, 4), [4, 8), [8, 16), [16, inf).
    p = BucketPredictor.fit([(3, 10), (3, 20), (9, 100), (12, 200)])
    assert p.edges == [2, 4, 8, 16]
    assert p.predict(request("a", 2)) == 15.0 and p.predict(request("b", 8)) == 150.0
    assert p.predict(request("c", 5)) == pytest.approx(330 / 4)  # an empty bucket: the overall mean
    assert p.predict(request("d", 500)) == pytest.approx(330 / 4)
    with pytest.raises(ValueError, match="at least one"):
        BucketPredictor.fit([])


def test_oracle_noisy_oracle_and_max_tokens():
    lengths = {"a": 40, "b": 7}
    oracle = make_predictor("oracle", lengths=lengths)
    assert oracle.predict(request("a", 3)) == 40 and oracle.predict(request("zz", 3, max_tokens=9)) == 9
    assert make_predictor("noisy-oracle", lengths=lengths, sigma=0.0).predict(request("a", 3)) == 40
    noisy = [make_predictor("noisy-oracle", lengths=lengths, sigma=1.0, seed=s).predict(request("a", 3))
             for s in (0, 0, 1)]
    assert noisy[0] == noisy[1] != noisy[2]  # deterministic per (seed, request id)
    assert make_predictor("max_tokens").predict(request("a", 3, max_tokens=77)) == 77
    with pytest.raises(ValueError, match="kind='psychic' is unknown"):
        make_predictor("psychic")
    with pytest.raises(ValueError, match="sigma=-1"):
        make_predictor("noisy-oracle", lengths=lengths, sigma=-1)


WORKLOAD = {"kind": "synthetic", "num_requests": 1500, "arrival": "offline", "vocab_size": 1000,
            "prompt_len": {"dist": "lognormal", "mean": 200, "sigma": 1.0, "min": 4, "max": 4096},
            "output_len": {"dist": "lognormal", "mean": 200, "sigma": 1.0, "min": 4, "max": 4096}}


@pytest.mark.parametrize(("rho", "low", "high"), [(0.0, -0.1, 0.1), (0.8, 0.6, 0.9)])
def test_bucket_learned_from_a_training_draw(rho, low, high):
    """Fitted on another seed's draw of the same workload, its ranking is as good as the prompt
    length's correlation with the output length allows; the oracle's error is 0."""
    cfg = {**WORKLOAD, "length_correlation": rho}
    run = build_workload(cfg, 3, 1000)
    bucket = build_predictor({"kind": "bucket"}, run, cfg, seed=3, vocab_size=1000)
    err = prediction_error(bucket, run)
    assert low < err["spearman"] < high and err["mae"] > 0 and err["kind"] == "bucket"
    assert prediction_error(build_predictor("oracle", run), run)["mae"] == 0.0
    with pytest.raises(ValueError, match="needs the workload's true output lengths"):
        build_predictor("oracle", None)


def test_bucket_from_a_trace_file(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f'{{"arrival_time": 0, "prompt_len": {p}, "output_len": {o}}}\n'
                            for p, o in [(3, 10), (3, 30), (20, 500)]))
    p = build_predictor({"kind": "bucket", "trace": str(path)}, None, None, vocab_size=1000)
    assert p.predict(request("a", 3)) == 20.0 and p.predict(request("b", 17)) == 500.0
    with pytest.raises(ValueError, match="policy.predictor.trace"):
        build_predictor({"kind": "bucket", "trace": str(tmp_path / "none.jsonl")}, None, None)
