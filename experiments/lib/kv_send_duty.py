"""The send side's duty-cycle sweep of `experiments.bench_kv_receive`: prefill steps on the sending
GPU while KV messages leave it (the gather into a staging buffer and NCCL's send kernel on the
link's side stream, beside the forward on the compute stream, as `KVLink.send` runs them in the
prefill engine), binned by the share of each step its link carried bytes: the
`send_busy_share_curve` the simulator prices a prefill replica's steps by
(sim/latency/kv_receive.py `send_busy_factor`).

The sender drives (`send_sweep`): its idle prefill step first (the link polled before each step,
as the engine's loop does), then for each link utilisation u one message every `wire / u` seconds
(`wire`: the median of three messages sent alone, post to completion), posted once a step is
launched, while the host waits for it, as the pair's front posts a send mid-step (or, with
`after_launch` off, between steps, before the next one's launch). For
each message it asks the receiver to post its receive and waits for the answer before it sends
(`serve_receives` on the receiving process: a receive posted long before its send can stall on
the GPU). A message is on the wire from its send call's return to the sender's waiter thread
seeing it complete (the sender's clock alone; seen within ~1 ms). The binning and the curve are
experiments/lib/kv_receive_duty.py's (`step_shares`, `share_bins`, `busy_share_curve`).
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from experiments.lib.kv_receive_duty import (
    busy_share_curve,
    duty_summary,
    format_bins,
    share_bins,
    step_shares,
)

POST, END = "post", "end"  # the sender's asks: post one receive; the sweep is over
MAX_IN_FLIGHT = 8  # sends in flight at most (each holds a staging buffer: ~440 MB for 240 blocks of Qwen3-0.6B)


def send_sweep(link, step: Callable[[], None], send_one: Callable[[], None], utilisations: Sequence[float],
               steps_per_setting: int, idle_steps: int, deadline: float, timeout_s: float,
               after_launch: bool = False) -> dict:
    """On the sending process: `idle_steps` prefill steps (`step`) with the link idle, then
    `steps_per_setting` for each u of `utilisations` while `send_one` (the receive asked for, then
    `KVLink.send` on `link`; nothing kept of the transfer) sends one message every `wire / u`
    seconds (those due at a step's start, at most `cap`; a lag of more than a period after posting
    dropped), `cap` = 2 + idle step / period in flight at most (MAX_IN_FLIGHT). The sends due are
    posted before the step is launched, outside its time; with `after_launch` (`step` then has
    `launch()` and `finish()`) once it is launched, while the host waits for it, as the pair's front
    posts a send during its running step: the step's time then holds the posting, which the
    device's work hides unless it is longer. Stops a setting at `deadline` (monotonic); every wait
    for the link within `timeout_s`. Returns `idle` (seconds), `wire_s`, the steps' (u, start,
    end) and the messages' (u, posted, finished) (u 0: the three alone)."""
    sent, wire, steps, idle = [0], [], [], []

    def send(u: float) -> None:
        try:
            send_one()
        except RuntimeError as e:  # the link failed: say where the sweep was
            raise RuntimeError(f"the send sweep at utilisation {u:g}: {sent[0]} sent, {len(wire)} ended, "
                               f"{link.num_in_flight} in flight, {len(steps)} steps: {e}") from e
        sent[0] += 1

    def post_due(u: float, period: float, cap: int, due: float) -> float:
        """Send what is due by now (at most `cap`); the next send's due time."""
        now, posted = time.monotonic(), 0
        while now >= due and link.num_in_flight < cap and posted < cap:
            send(u)
            due, posted = due + period, posted + 1
        return max(due, time.monotonic() - period)  # posting slower than the period piles nothing up

    def settle(u: float, ended: Sequence[object]) -> None:
        """Keep the ended sends' times, not their staging buffers (one message's bytes each)."""
        for t in ended:
            if t.error is not None:
                raise RuntimeError(f"a send of the send sweep at utilisation {u:g} failed: {t.error}")
            wire.append((u, t.posted_at, t.finished_at))

    link.wait_all(timeout_s)  # the sends before the sweep, let go
    for _ in range(idle_steps):
        if time.monotonic() > deadline:
            break
        t0 = time.monotonic()
        settle(0.0, link.poll())
        step()
        idle.append(time.monotonic() - t0)
    if not idle:
        raise RuntimeError("the send sweep's deadline passed before its idle steps")
    idle_s = statistics.median(idle)
    for _ in range(3):
        send(0.0)
        settle(0.0, link.wait_all(timeout_s))
    if len(wire) < 3:
        raise RuntimeError(f"a send of the send sweep did not complete within {timeout_s} s")
    wire_s = statistics.median(t1 - t0 for _, t0, t1 in wire)
    for u in utilisations:
        period, got = wire_s / u, 0
        cap, due = min(MAX_IN_FLIGHT, 2 + math.ceil(idle_s / period)), time.monotonic()  # `due`: the next send
        while got < steps_per_setting and time.monotonic() <= deadline:
            if not after_launch:
                due = post_due(u, period, cap, due)
            t0 = time.monotonic()
            ended = link.poll()  # the sends that ended let go of their staging buffers
            if after_launch:
                step.launch()
                due = post_due(u, period, cap, due)
                step.finish()
            else:
                step()
            steps.append((u, t0, time.monotonic()))
            settle(u, ended)
            got += 1
        settle(u, link.wait_all(timeout_s))
    if len(wire) != sent[0]:
        raise RuntimeError(f"{sent[0] - len(wire)} sends of the send sweep did not complete within {timeout_s} s")
    return {"idle": idle, "wire_s": wire_s, "steps": steps, "sends": wire}


def serve_receives(link, conn, post_receive: Callable[[], object], timeout_s: float) -> tuple[int, int]:
    """On the receiving process: for each POST from the sender (`conn`), a receive posted
    (`post_receive`, nothing kept of it) and "posted" answered; at END, every receive waited for.
    Ended receives are polled off the link at each message (their staging buffers let go).
    Returns (posted, completed); each wait for the sender within `timeout_s`."""
    posted = completed = 0
    while True:
        if not conn.poll(timeout_s):
            raise RuntimeError(f"the sender asked for no receive within {timeout_s} s ({posted} posted)")
        msg = conn.recv()
        completed += sum(t.error is None for t in link.poll())
        if msg == END:
            break
        post_receive()
        posted += 1
        conn.send("posted")
    completed += sum(t.error is None for t in link.wait_all(timeout_s))
    return posted, completed


def send_rows(sweep: dict) -> list[dict]:
    """Each step of `send_sweep`: its utilisation, start (from the sweep's first), seconds, wire
    share (its outgoing link's messages) and time over the median idle step."""
    steps, idle_s = sweep["steps"], statistics.median(sweep["idle"])
    if not steps:
        return []
    starts, ends = [t0 for _, t0, _ in steps], [t1 for *_, t1 in steps]
    shares = step_shares(starts, ends, [(t0, t1) for _, t0, t1 in sweep["sends"]])
    return [{"setting": u, "start_s": round(t0 - starts[0], 6), "step_s": t1 - t0, "share": round(share, 4),
             "over_idle": round((t1 - t0) / idle_s, 4)} for (u, t0, t1), share in zip(steps, shares)]


def summarise_send(rows: list[dict]) -> tuple[str, dict[str, str], str]:
    """The `send_busy_share_curve`, the metadata lines (`send_share_bin ...`, `send duty ...`) and
    the text to print."""
    bins = share_bins(np.array([r["share"] for r in rows]), np.array([r["over_idle"] for r in rows]))
    meta = {f"send_share_bin {b.label}": f"steps {b.steps} share {b.share:.4f} median {b.median:.4f} "
            f"mean {b.mean:.4f}" for b in bins}
    summaries = []
    for u in dict.fromkeys(r["setting"] for r in rows):
        meta[f"send duty {u:g}"] = duty_summary([r for r in rows if r["setting"] == u])
        summaries.append(f"u {u:g}: {meta[f'send duty {u:g}']}")
    text = "prefill steps beside sends: " + "; ".join(summaries) + "\n" + format_bins(bins, "step / idle step")
    return busy_share_curve(bins), meta, text
