"""`experiments.search_check` on the engine: a two-deployment search of Qwen3-0.6B (dummy bf16
weights) on this machine's GPU type, simulated on the CPU, then both deployments run on the GPU at
their bracketing rates. Checks the engine side end to end (the run configs rebuilt from the
search's config.yaml, the warm-up, the device checks, the report), not the simulator's accuracy.

Run on the GPU machine (about a minute):
    python -m pytest -q -m gpu tests/device/test_search_check_gpu.py
"""
import sys

import pandas as pd
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def test_a_search_checked_on_the_engine(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from experiments import search as search_module
    from experiments import search_check
    name = torch.cuda.get_device_name().lower()
    gpu = next((g for g in ("h200", "h100", "a100") if g in name), None)
    if gpu is None:
        pytest.skip(f"{name!r} is not a catalogue GPU type")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", [
        "search", "model=qwen3-0.6b", "workload=poisson", "workload.prompt_len={dist: uniform, low: 16, high: 128}",
        "workload.output_len={dist: uniform, low: 16, high: 64}", "search.duration_s=3", "search.rate.growth=2",
        "search.rate.max_iterations=8", "search.slo.ttft_s=0.5", "search.slo.tpot_s=0.02", f"search.space.gpu=[{gpu}]",
        "search.space.tensor_parallel_size=[1]", "search.space.replicas=[1]", "search.space.max_num_seqs=[2,16]",
        "search.space.max_num_batched_tokens=[512]", "search.target_rate=1", f"search.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'search'}"])
    search_module.main()
    frame = search_check._main([str(tmp_path / "search"), "--out", str(tmp_path / "check"), "--warmup-s", "1"])
    assert list(frame["role"]) == ["pick", "neighbour"]
    assert (frame["backend"] == "engine").all() and frame["device"].str.lower().str.contains(gpu).all()
    probes = pd.read_csv(tmp_path / "check" / "probes.csv")
    assert len(probes) >= 4 and (probes["num_requests"] >= 20).all()
    assert (tmp_path / "check" / "check.md").read_text().count("| pick |") == 1
