"""`experiments.bench_kv_receive` on CPU (gloo, tiny-qwen3): a row per message size, bytes from the
model's KV shape, scatter and send timed, decode steps idle and beside receives, and the receive
profile it writes read back by the simulator's reader."""
from __future__ import annotations

import sys

from experiments import bench_kv_receive
from sim.latency.kv_receive import read_receive_profile


def test_bench_runs_on_cpu_and_writes_a_receive_profile(tmp_path, monkeypatch, capsys):
    out = tmp_path / "receive.csv"
    monkeypatch.setattr(sys, "argv", [
        "bench_kv_receive", "--device", "cpu", "--model", "tiny-qwen3", "--blocks", "1,4", "--iters", "2",
        "--decode-seqs", "2", "--context", "32", "--busy-blocks", "4", "--wave", "2", "--steps", "3",
        "--rounds", "1", "--budget-s", "60", "--out", str(out)])
    bench_kv_receive.main()
    price = read_receive_profile(out)
    assert len(price.bytes_at) == 2 and price.bytes_at[1] == 4 * price.bytes_at[0]
    assert all(s > 0 for s in price.scatter_at) and all(s > 0 for s in price.send_host_at)
    assert price.busy_step_factor >= 1.0
    text = out.read_text()
    assert "# steps_idle_busy: 3 3" in text and "# decode_step_idle_s:" in text
    assert "busy_step_factor" in capsys.readouterr().out
