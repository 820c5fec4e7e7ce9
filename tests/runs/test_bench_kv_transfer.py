"""`experiments.bench_kv_transfer` on CPU (gloo): a table row per request size, bytes from the
model's KV shape, both layouts and the copy measured, the JSON written."""
from __future__ import annotations

import json
import sys

from experiments import bench_kv_transfer


def test_bench_runs_on_cpu_and_writes_its_table(tmp_path, monkeypatch, capsys):
    out = tmp_path / "kv.json"
    monkeypatch.setattr(sys, "argv", ["bench_kv_transfer", "--device", "cpu", "--model", "tiny-llama",
                                      "--tokens", "4,40", "--iters", "2", "--block-size", "4", "--out", str(out)])
    bench_kv_transfer.main()
    table = json.loads(out.read_text())
    rows = table["rows"]
    assert [r["tokens"] for r in rows] == [4, 40] and [r["blocks"] for r in rows] == [1, 10]
    assert all(r["bytes"] == r["blocks"] * table["block_bytes"] for r in rows)
    assert all(r["staged_gbps"] > 0 and r["per-layer_gbps"] > 0 and r["copy_gbps"] > 0 for r in rows)
    assert "staged/copy" in capsys.readouterr().out
