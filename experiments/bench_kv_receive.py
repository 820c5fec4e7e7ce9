"""`python -m experiments.bench_kv_receive --out FILE.csv`: what a KV message costs the two engines of
a prefill/decode pair beside the link itself, timed on their own, written as the receive profile the
simulator reads (`cluster.kv_receive_profile`, sim/latency/kv_receive.py; docs/disaggregation.md).

Two processes on two GPUs of one host, as the pair runs (cuda:0 sends, cuda:1 receives, the
engine's `KVLink` over NCCL; `--device cpu`: gloo and the CPU, a smoke test whose figures are the
loopback's). The receiver builds the decode engine's `ModelRunner` (dummy weights, CUDA graphs) and
its KV cache; for each message size of `--blocks` (blocks of the model's KV, every layer's K and V):

- `scatter_s`: the decode side's scatter of a received message into its blocks, as `KVLink.scatter`
  runs it (block ids from pinned memory, one `kernels.scatter_blocks` launch on the compute stream),
  device time between CUDA events: what the next decode step waits for. Median of `--iters`.
- `send_host_s`: the prefill side's host time in `KVLink.send` (staging buffer, gather launch, the
  send call; after the compute stream's work, as the synchronous front posts it), the receive
  posted first. Median of `--iters`.

Then `busy_step_factor`: decode steps of `--decode-seqs` sequences reading `--context` tokens each
(a synthetic step, scheduled ahead as the pair's engines run with async scheduling: each step
launched before the one in flight is waited for, a step's time the period between steps;
`--sync-steps`: each step launched and waited for, the host's work in series with the device's),
alternately with the link idle and while
messages of `--busy-blocks` blocks are received back to back (waves of `--wave` receives posted at
once, the pair's `max_transfers_in_flight`), no scatter: the median step with a receive on the wire
from its start to its end over the median idle step, over `--rounds` rounds of `--steps` steps each.
The engine's own receive path runs beside the steps, as in the decode engine: the receiving
`KVLink`'s waiter thread in the runner's process, and the step loop polling the link every turn.
`busy_step_factor` is a record of the saturated link, not what the simulator prices.

Then the duty-cycle sweep, what the simulator prices (`busy_share_curve`;
experiments/lib/kv_receive_duty.py): the same steps while single messages of `--duty-blocks` blocks
are sent one every `wire / u` seconds for each link utilisation u of `--duty` (`wire`: the median
time of such a message received alone, post to completion), each receive posted `lead` before its
send for each lead of `--post-lead-ms` (the decode engine posts a receive when it reserves the
blocks, `link_wait` before the send; the default is 0 alone: a lead of 13 ms once ended the run
on two H200s, each step then synchronising the whole device and so waiting for a receive whose
send it had not yet asked for, and the steps now wait for the compute stream only), `--duty-steps`
steps per setting. Each message is on the wire
from the later of the receive's posting and the send call's return (the two processes share the
host's monotonic clock) to the waiter thread's completion (seen within ~1 ms); each step's share is
the part of its wall time that the wire intervals cover (the simulator's rule), its posted share
the part a receive was posted and not complete, its ratio its time over the median idle step. The
steps of each lead are binned by share; with the first lead, each bin with the wire busy and 5
steps or more gives a point (mean share, median ratio, at least 1) of `busy_share_curve`. The
profile's header holds the curve, every lead's bins (`share_bin ...`), each setting's summary
(`duty ...`), the ratio of the steps with the wire idle and a receive posted for half of them or
more (`wire idle, posted ...`) and `format: 2`; every step of the sweep goes to `OUT` with
`-steps.csv` for its name's `.csv`.

Then the send side's duty-cycle sweep (`send_busy_share_curve`; experiments/lib/kv_send_duty.py),
on the sending GPU: the sender builds the prefill engine's `ModelRunner` (dummy weights, CUDA
graphs up to 8192 tokens, as the pair's runs; its KV cache is what every send gathers from) while
the receiver builds its own; prefill steps of `--prefill-tokens` tokens in `--prefill-seqs` prompts
(the link polled before each, as the engine's loop does; each step waited for, as the pair's front
runs them synchronously), `--send-steps` with the link idle, then
`--send-steps` for each u of `--duty` while messages of `--duty-blocks` blocks are sent one every
`wire / u` seconds (each receive posted by the receiver right before its send, which waits for
it; the gather does not wait for the compute stream, as the front's sends posted during a step
do not; the sends due at a step are posted once it is launched, as the front posts them while it
waits for its step, or with `--send-posted before-launch` before it). A message is on the wire
from its send call's return to its completion on the sender; the steps are binned by share as
above and each bin with the wire busy and 5 steps or more gives a point of `send_busy_share_curve`. The header gains the curve, its bins (`send_share_bin ...`),
each setting's summary (`send duty ...`), `prefill_step_idle_s` and `send_wire_alone_s`; its steps
go to `OUT` with `-send-steps.csv` for `.csv`.

Bounded: the measurements after the receiver's runner is built by `--budget-s` (sizes left are
skipped, rounds cut short; a sweep cut short is an error, nothing written), each side's build by
STARTUP_S (experiments/lib/kv_receive_sides.py, where each process's measurements live), every
other wait for the other process by the link's timeout. Runs in ~60-80 s on two H200s (the
runners' builds, torch.compile and CUDA graphs, 20-40 s each, at once; the measurements ~35 s).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import multiprocessing
import statistics
import time
from pathlib import Path

import torch

from engine.disagg.kv_transfer import SEND_RANK, KVLink, open_store
from experiments.lib.kv_link_bench import LINK_TIMEOUT_S
from experiments.lib.kv_receive_duty import summarise, sweep_rows
from experiments.lib.kv_receive_sides import STARTUP_S, build_runner, prefill_shape, receive_side, send_side
from experiments.lib.kv_send_duty import send_rows, summarise_send
from sim.latency.kv_receive import CURVE_KEY, FORMAT, SEND_CURVE_KEY, write_receive_profile

DEFAULT_BLOCKS = "1,8,32,128,256,512"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="conf/model name (tiny-qwen3 for a CPU smoke run)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", default=DEFAULT_BLOCKS, help="message sizes in blocks, comma-separated")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--decode-seqs", type=int, default=104, help="the decode step's sequences")
    ap.add_argument("--context", type=int, default=700, help="KV tokens each decode reads")
    ap.add_argument("--busy-blocks", type=int, default=240, help="blocks of each message received beside the steps")
    ap.add_argument("--wave", type=int, default=8, help="receives posted at once")
    ap.add_argument("--steps", type=int, default=60, help="decode steps per round, idle and busy each")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duty", default="0.25,0.5,0.75,1.0",
                    help="link utilisations of the duty-cycle sweep, comma-separated in (0, 1]")
    ap.add_argument("--duty-blocks", type=int, default=240, help="blocks of each message of the duty sweep")
    ap.add_argument("--duty-steps", type=int, default=300, help="decode steps per setting")
    ap.add_argument("--post-lead-ms", default="0",
                    help="the duty sweep's receives posted this long before their send, comma-separated ms >= 0 "
                         "(the curve: the first; 13: pd_400's mean link_wait)")
    ap.add_argument("--prefill-tokens", type=int, default=4000,
                    help="tokens of the send sweep's prefill step (pd_400's prefill steps: ~4,000)")
    ap.add_argument("--prefill-seqs", type=int, default=6, help="prompts of that step (pd_400's: 256-1024 tokens)")
    ap.add_argument("--send-steps", type=int, default=200, help="prefill steps idle, then per setting of the send sweep")
    ap.add_argument("--sync-steps", action="store_true",
                    help="the decode side waits for each step before launching the next (default: one step in "
                         "flight, as the decode engine schedules ahead); the send sweep's prefill steps are "
                         "synchronised either way, as the pair's front runs them")
    ap.add_argument("--send-posted", choices=("after-launch", "before-launch"), default="after-launch",
                    help="when the send sweep posts the sends due at a step: once the step is launched, while "
                         "the host waits for it (as the pair's front posts them mid-step), or before its launch")
    ap.add_argument("--decode-kernel", default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop measuring after this many seconds")
    ap.add_argument("--out", type=Path, required=True, help="the receive profile (CSV) to write")
    a = ap.parse_args()
    try:
        sizes = sorted({int(b) for b in a.blocks.split(",")})
    except ValueError:
        raise SystemExit(f"error: --blocks={a.blocks!r} is invalid: positive integers, comma-separated") from None
    if len(sizes) < 2 or sizes[0] < 1:
        raise SystemExit(f"error: --blocks={a.blocks!r} is invalid: at least two sizes, each >= 1")
    try:
        a.duty_utilisations = [float(u) for u in a.duty.split(",")]
    except ValueError:
        a.duty_utilisations = []
    if not a.duty_utilisations or any(not 0 < u <= 1 for u in a.duty_utilisations):
        raise SystemExit(f"error: --duty={a.duty!r} is invalid: link utilisations in (0, 1], comma-separated")
    try:
        a.post_leads = [float(x) for x in a.post_lead_ms.split(",")]
    except ValueError:
        a.post_leads = []
    if not a.post_leads or any(not 0 <= x < 1000 for x in a.post_leads):
        raise SystemExit(f"error: --post-lead-ms={a.post_lead_ms!r} is invalid: milliseconds in [0, 1000), "
                         "comma-separated")
    if a.duty_blocks < 1 or a.duty_steps < 1:
        raise SystemExit(f"error: --duty-blocks={a.duty_blocks} / --duty-steps={a.duty_steps} are invalid: each >= 1")
    if a.send_steps < 1 or not 1 <= a.prefill_seqs <= a.prefill_tokens \
            or -(-a.prefill_tokens // a.prefill_seqs) > 4096:
        raise SystemExit(f"error: --prefill-tokens={a.prefill_tokens} / --prefill-seqs={a.prefill_seqs} / "
                         f"--send-steps={a.send_steps} are invalid: 1 <= seqs <= tokens, at most 4096 tokens a "
                         "prompt, steps >= 1")
    if a.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("error: --device cuda needs two GPUs (cuda:0 sends, cuda:1 receives); --device cpu: gloo")
    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:  # one op thread a process: spinning op threads beside the links' threads stall a step on few cores
        torch.set_num_threads(1)
    store = open_store(LINK_TIMEOUT_S)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=receive_side, args=(store.port, theirs, a), daemon=True)
    proc.start()
    link = KVLink(SEND_RANK, store, dev, LINK_TIMEOUT_S)
    try:
        built = time.monotonic()  # the prefill engine's runner, while the receiver builds its own
        runner = build_runner(a, dev, prefill_shape(a), max(8192, a.prefill_tokens), 256)
        if time.monotonic() - built > STARTUP_S:
            raise SystemExit(f"error: the sender's runner took {time.monotonic() - built:.0f} s to build "
                             f"(at most {STARTUP_S:.0f} s)")
        k = runner.kv_cache.k_caches
        block_bytes = 2 * len(k) * k[0][0].numel() * k[0].element_size()
        got = send_side(link, ours, runner, a)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        link.close()
    idle, busy = statistics.median(got["idle"]), statistics.median(got["busy"]) if got["busy"] else None
    factor = max(1.0, busy / idle) if busy else 1.0
    rows = [{"blocks": n, "bytes": n * block_bytes, "scatter_s": got["scatter"][n], "send_host_s": got["send"][n]}
            for n in sizes if n in got["send"]]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (gloo)"
    sweep = sweep_rows(got["sweep"], got["sent_at"], idle)
    curve, sweep_meta, sweep_text = summarise(sweep, a.post_leads)
    sends = send_rows(got["send_sweep"])
    send_curve, send_meta, send_text = summarise_send(sends)
    prefill_idle = statistics.median(got["send_sweep"]["idle"])
    meta = {"format": FORMAT, "model": a.model, "device": name, "block_size": a.block_size,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "versions": f"torch {torch.__version__}", "command": "python -m experiments.bench_kv_receive " + " ".join(
                f"--{key.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
                for key, value in vars(a).items()
                if key not in ("duty_utilisations", "post_leads") and value is not False),
            CURVE_KEY: curve, "duty_wire_alone_s": f"{got['sweep']['wire_s']:.6e}", **sweep_meta,
            "busy_step_factor": f"{factor:.4f}", "busy_over_idle": f"{busy / idle:.4f}" if busy else "-",
            "decode_step_idle_s": f"{idle:.6e}",
            "decode_step_busy_s": f"{busy:.6e}" if busy else "-",
            "steps_idle_busy": f"{len(got['idle'])} {len(got['busy'])}",
            SEND_CURVE_KEY: send_curve, "send_wire_alone_s": f"{got['send_sweep']['wire_s']:.6e}",
            "prefill_step_idle_s": f"{prefill_idle:.6e}", **send_meta}
    print(f"{a.model} on {name}: block {block_bytes / 2**20:.2f} MiB")
    print(f"{'blocks':>7} {'MiB':>8} {'scatter ms':>11} {'GB/s':>7} {'send host ms':>13}")
    for r in rows:
        print(f"{r['blocks']:>7} {r['bytes'] / 2**20:>8.1f} {r['scatter_s'] * 1e3:>11.3f} "
              f"{r['bytes'] / r['scatter_s'] / 1e9:>7.0f} {r['send_host_s'] * 1e3:>13.3f}")
    print(f"decode step ({a.decode_seqs} x {a.context} tokens): idle {idle * 1e3:.3f} ms ({len(got['idle'])} steps), "
          f"beside receives of {a.busy_blocks} blocks {meta['decode_step_busy_s']} s ({len(got['busy'])} steps): "
          f"busy_step_factor {factor:.3f}")
    print(f"duty sweep: messages of {a.duty_blocks} blocks, {got['sweep']['wire_s'] * 1e3:.3f} ms alone on the wire")
    print(sweep_text)
    print(f"{CURVE_KEY}: {curve}")
    print(f"send sweep: prefill steps of {a.prefill_tokens} tokens in {a.prefill_seqs} prompts, idle "
          f"{prefill_idle * 1e3:.3f} ms; messages of {a.duty_blocks} blocks, "
          f"{got['send_sweep']['wire_s'] * 1e3:.3f} ms alone on the wire")
    print(send_text)
    print(f"{SEND_CURVE_KEY}: {send_curve}")
    if len(rows) < 2:
        raise SystemExit(f"error: --budget-s={a.budget_s} ran out before two message sizes were timed")
    if len(sweep) < len(a.duty_utilisations) * len(a.post_leads) * a.duty_steps:
        raise SystemExit(f"error: --budget-s={a.budget_s} ran out during the duty sweep ({len(sweep)} of "
                         f"{len(a.duty_utilisations) * len(a.post_leads) * a.duty_steps} steps): a larger budget")
    if len(sends) < len(a.duty_utilisations) * a.send_steps:
        raise SystemExit(f"error: --budget-s={a.budget_s} ran out during the send sweep ({len(sends)} of "
                         f"{len(a.duty_utilisations) * a.send_steps} steps): a larger budget")
    write_receive_profile(a.out, meta, rows)
    steps_out = a.out.with_name(a.out.stem + "-steps.csv")
    with open(steps_out, "w", newline="") as f:
        writer = csv.DictWriter(f, ("setting", "lead_ms", "start_s", "step_s", "share", "posted", "over_idle"))
        writer.writeheader()
        writer.writerows(sweep)
    send_out = a.out.with_name(a.out.stem + "-send-steps.csv")
    with open(send_out, "w", newline="") as f:
        writer = csv.DictWriter(f, ("setting", "start_s", "step_s", "share", "over_idle"))
        writer.writeheader()
        writer.writerows(sends)
    print(f"wrote {a.out}, {steps_out} and {send_out}")


if __name__ == "__main__":
    main()
