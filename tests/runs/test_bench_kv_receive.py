"""`experiments.bench_kv_receive` on CPU (gloo, tiny-qwen3): a row per message size, bytes from the
model's KV shape, scatter and send timed, decode steps idle and beside receives, prefill steps beside sends, and
the receive profile it writes read back by the simulator's reader."""
from __future__ import annotations

import sys

import pandas as pd

from experiments import bench_kv_receive
from sim.latency.file_meta import read_meta
from sim.latency.kv_receive import SEND_CURVE_KEY, parse_curve, read_receive_profile


def test_bench_runs_on_cpu_and_writes_a_receive_profile(tmp_path, monkeypatch, capsys):
    out = tmp_path / "receive.csv"
    monkeypatch.setattr(sys, "argv", [
        "bench_kv_receive", "--device", "cpu", "--model", "tiny-qwen3", "--blocks", "1,4", "--iters", "2",
        "--decode-seqs", "2", "--context", "32", "--busy-blocks", "4", "--wave", "2", "--steps", "3",
        "--rounds", "1", "--duty", "0.5,1", "--duty-blocks", "4", "--duty-steps", "6", "--post-lead-ms", "0,5", "--prefill-tokens", "48", "--prefill-seqs", "2", "--send-steps", "6",
        "--budget-s", "200",
        "--out", str(out)])
    bench_kv_receive.main()
    text = out.read_text()
    checked = tmp_path / "checked.csv"  # the reader's bounds on the rest (the send curve: below)
    checked.write_text("".join(line for line in text.splitlines(keepends=True) if SEND_CURVE_KEY not in line))
    price = read_receive_profile(checked)
    assert len(price.bytes_at) == 2 and price.bytes_at[1] == 4 * price.bytes_at[0]
    assert all(s > 0 for s in price.scatter_at) and all(s > 0 for s in price.send_host_at)
    assert all(1.0 <= f for f in price.busy_factor_at)  # the duty sweep's curve
    assert "# steps_idle_busy: 3 3" in text and "# decode_step_idle_s:" in text and "# format: 2" in text
    assert "# busy_step_factor:" in text and "# duty 0.5: steps 6 " in text and "# duty 1 lead 5ms: steps 6 " in text
    assert "# wire idle, posted lead 5ms: steps " in text
    steps = pd.read_csv(out.with_name("receive-steps.csv"))
    assert len(steps) == 24 and steps.groupby(["setting", "lead_ms"]).size().to_dict() == {
        (0.5, 0.0): 6, (0.5, 5.0): 6, (1.0, 0.0): 6, (1.0, 5.0): 6}
    assert steps["share"].between(0, 1).all() and (steps["over_idle"] > 0).all()
    assert (steps["posted"] >= steps["share"] - 1e-3).all()  # on the wire only once posted
    # The send side's sweep: prefill steps on the sender beside its own sends. Its curve's values are
    # the loopback's on the CPU (any factor >= 1, past what the simulator's reader takes): its syntax.
    shares, factors = parse_curve(read_meta(text.splitlines())[0], out, SEND_CURVE_KEY)
    assert shares and all(1.0 <= f for f in factors)
    assert "# send_busy_share_curve: " in text and "# prefill_step_idle_s: " in text
    assert "# send duty 0.5: steps 6 " in text and "# send duty 1: steps 6 " in text and "# send_share_bin " in text
    sends = pd.read_csv(out.with_name("receive-send-steps.csv"))
    assert sends.groupby("setting").size().to_dict() == {0.5: 6, 1.0: 6}
    assert sends["share"].between(0, 1).all() and (sends["over_idle"] > 0).all() and sends["share"].max() > 0
    printed = capsys.readouterr().out
    assert "busy_step_factor" in printed and "busy_share_curve:" in printed and "wire share" in printed
    assert "prefill steps beside sends" in printed and "send_busy_share_curve:" in printed
