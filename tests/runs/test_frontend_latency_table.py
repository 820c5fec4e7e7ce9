"""The front-end latency benchmark's bookkeeping (experiments/bench_frontend.py, lib/frontend_latency.py):
the prompt length reaches every path's body, and the paired client-minus-server row is per request."""
from __future__ import annotations

from optional_deps import require_serving

require_serving()

from experiments.bench_frontend import latency_table
from experiments.lib import frontend_latency


def test_prompt_len_reaches_the_http_body_and_the_engine_paths():
    try:
        frontend_latency.set_prompt_len(1000)
        assert frontend_latency.BODY["prompt"] is frontend_latency.PROMPT
        assert len(frontend_latency.PROMPT) == 1000 and max(frontend_latency.PROMPT) < 256  # tiny-llama's vocabulary
        assert frontend_latency.engine_args().max_model_len >= 1000 + frontend_latency.BODY["max_tokens"]
    finally:
        frontend_latency.set_prompt_len(32)
    assert frontend_latency.PROMPT == list(range(1, 33))


def test_paired_row_is_the_median_of_per_request_differences():
    # The columns' medians differ by 10 ms; the requests themselves by 1, 10 and 3 ms.
    samples = {"tree": {"engine": [0.010, 0.010, 0.010], "http_raw": [0.011, 0.030, 0.063],
                        "http_raw_own": [0.010, 0.020, 0.060]}}
    table = latency_table(samples, {"tree": {}})
    assert "| http_raw minus the server's own, paired median (ms) | 3.000 |" in table
    samples["tree"]["http_raw_own"].pop()  # unpaired: no row value
    assert "| http_raw minus the server's own, paired median (ms) | - |" in latency_table(samples, {"tree": {}})
