"""Decode steps grouped by the share of them a KV receive's bytes were on the wire: the table both
`experiments.bench_kv_receive`'s duty-cycle sweep and `experiments.lab.decode_excess --by-share`
print, and the `busy_share_curve` the bench writes for the simulator (sim/latency/kv_receive.py);
the sweep itself, as the bench's receiving process runs it (`duty_sweep`).

A step's share is the part of its wall time (the bench) or period (an engine run's step) that the
union of the wire intervals covers (`sim.latency.kv_receive.wire_share`, the simulator's own rule);
its ratio is its time over the idle step (the bench) or over its profiled price (an engine run);
an engine run's wire intervals come from its request rows (`wire_intervals`).
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sim.latency.kv_receive import wire_share

# (label, lowest share, highest share), both ends in the bin; "0" and "1" are the steps the wire
# left idle and the steps it covered whole (a waiter's completion is seen within ~1 ms: 0.999).
SHARE_BINS = (("0", 0.0, 0.001), ("0-0.25", 0.001, 0.25), ("0.25-0.5", 0.25, 0.5), ("0.5-0.75", 0.5, 0.75),
              ("0.75-1", 0.75, 0.999), ("1", 0.999, 1.0))
MIN_BIN_STEPS = 5  # a bin with fewer steps gives no point of the curve


@dataclass(slots=True, frozen=True)
class ShareBin:
    label: str
    steps: int
    share: float  # the steps' mean share
    median: float  # their median ratio
    mean: float  # their mean ratio


def step_shares(starts: Sequence[float], ends: Sequence[float], intervals: Sequence[tuple[float, float]]) -> np.ndarray:
    """Per step [start, end]: the share of it the union of `intervals` covers."""
    spans = sorted(intervals)
    begins = np.array([a for a, _ in spans], dtype=float)
    out = np.zeros(len(starts))
    for i, (t0, t1) in enumerate(zip(starts, ends)):
        near = spans[:int(np.searchsorted(begins, t1))]  # only those that began before the step's end
        out[i] = wire_share(t0, t1, [w for w in near if w[1] > t0])
    return out


def prefill_ends(requests: pd.DataFrame) -> pd.Series:
    """When each handed-off request's prefill ended (its first token sampled, its hand-off made):
    the trace's arrival + queueing + prefill time. The decode side reserved its blocks
    `decode_wait` later."""
    return requests["arrival_time"] + requests["queueing_time"] + requests["prefill_time"]


def send_posts(requests: pd.DataFrame) -> pd.Series:
    """When each handed-off request's KV send was posted: the `link_time` before its transfer's
    end (its prefill's end, the decode side's `decode_wait` and the front's `link_wait` later)."""
    return prefill_ends(requests) + requests["transfer_time"] - requests["link_time"]


def wire_intervals(requests: pd.DataFrame | None, posted: bool = False) -> list[tuple[float, float]]:
    """An engine run's KV messages on the wire, from its `requests.parquet` rows: each handed-off
    request's (from its send, or its posting with `posted`; to the end of its transfer). None or
    no hand-off columns: none."""
    if requests is None or "link_time" not in requests.columns:
        return []
    r = requests[requests["link_time"].notna()]
    done = prefill_ends(r)
    start = (done + r["decode_wait"] if posted else send_posts(r)).to_numpy(dtype=float)
    stop = (done + r["transfer_time"]).to_numpy(dtype=float)
    return list(zip(start.tolist(), stop.tolist()))


def share_bins(shares: np.ndarray, ratios: np.ndarray) -> list[ShareBin]:
    """The steps by SHARE_BINS (bins without steps left out)."""
    shares, ratios = np.asarray(shares, dtype=float), np.asarray(ratios, dtype=float)
    taken = np.zeros(len(shares), dtype=bool)
    out = []
    for label, low, high in SHARE_BINS:
        inside = ~taken & (shares >= low) & (shares <= high)
        taken |= inside
        if inside.any():
            out.append(ShareBin(label, int(inside.sum()), float(shares[inside].mean()),
                                float(np.median(ratios[inside])), float(ratios[inside].mean())))
    return out


def busy_share_curve(bins: Sequence[ShareBin]) -> str:
    """`busy_share_curve` from the bins with the wire busy and MIN_BIN_STEPS steps or more: each
    bin's mean share and median ratio (at least 1); `1:1` (no busy-link price) with none."""
    points = [(b.share, max(1.0, b.median)) for b in bins if b.label != "0" and b.steps >= MIN_BIN_STEPS]
    points = [p for i, p in enumerate(points) if i == 0 or p[0] > points[i - 1][0]]
    return " ".join(f"{s:.4f}:{f:.4f}" for s, f in points) or "1:1"


def format_bins(bins: Sequence[ShareBin], what: str) -> str:
    """The table, `what` naming the ratio (e.g. "step / idle step")."""
    lines = [f"  {'wire share':>10} {'steps':>6} {'mean share':>10} {'median ' + what:>22} {'mean':>7}"]
    lines += [f"  {b.label:>10} {b.steps:>6} {b.share:>10.3f} {b.median:>22.3f} {b.mean:>7.3f}" for b in bins]
    return "\n".join(lines)


def duty_sweep(link, step: Callable[[], None], ask_send: Callable[[], None], post_receive: Callable[[], object],
               settings: Sequence[tuple[float, float]], steps_per_setting: int, deadline: float,
               timeout_s: float) -> dict:
    """Decode steps (`step`, the link polled before each, as the decode loop does) beside single
    messages: for each (u, lead) of `settings` a receive (`post_receive`, on the receiving
    `KVLink` `link`) posted `lead` seconds before its send is asked for (`ask_send`; asked between
    steps), one send every `wire / u` seconds (`wire`: the median of three messages received
    alone, post to completion), at most 2 + lead / period posted. Stops each setting after
    `steps_per_setting` steps or at `deadline` (monotonic); every wait for the link within
    `timeout_s`. Returns `wire_s`, the steps' (u, lead, start, end) and the receives' (u, lead,
    posted, finished) (u 0: the three alone)."""
    posted, steps, waiting = [], [], {}  # posted: (u, lead, transfer or its (posted, finished) times)

    def post(u: float, lead: float) -> None:
        try:
            waiting[len(posted)] = transfer = post_receive()
        except RuntimeError as e:  # the link failed: say where the sweep was
            raise RuntimeError(f"the duty sweep at utilisation {u:g}, lead {lead * 1e3:g} ms: {len(posted)} "
                               f"receives posted, {len(waiting)} not ended, {link.num_in_flight} in flight, "
                               f"{len(steps)} steps: {e}") from e
        posted.append((u, lead, transfer))

    def settle(ended: Sequence[object]) -> None:
        """Keep the ended receives' times, not their staging buffers (one message's bytes each)."""
        done = {id(t) for t in ended}
        for i in [i for i, t in waiting.items() if id(t) in done]:
            t = waiting.pop(i)
            posted[i] = (*posted[i][:2], (t.posted_at, t.finished_at if t.error is None else None))

    for _ in range(3):
        post(0.0, 0.0)
        ask_send()
        settle(link.wait_all(timeout_s))
    alone = [t[1] - t[0] for *_, t in posted if isinstance(t, tuple) and t[1] is not None]
    if len(alone) < 3:
        raise RuntimeError(f"a receive of the duty sweep did not complete within {timeout_s} s")
    wire_s = statistics.median(alone)
    for u, lead in settings:
        period, got, asks = wire_s / u, 0, deque()
        cap, due = 2 + math.ceil(lead / period), time.monotonic() + lead  # `due`: the next send
        while got < steps_per_setting and time.monotonic() <= deadline:
            now = time.monotonic()
            if now >= due - lead and link.num_in_flight < cap:
                post(u, lead)
                asks.append(due)
                due = max(due + period, now + lead)
            while asks and asks[0] <= time.monotonic():
                asks.popleft()
                ask_send()
            t0 = time.monotonic()
            ended = link.poll()
            step()
            steps.append((u, lead, t0, time.monotonic()))
            settle(ended)
            got += 1
        for _ in asks:  # the receives posted last still get their sends
            ask_send()
        settle(link.wait_all(timeout_s))
    if any(not isinstance(t, tuple) or t[1] is None for *_, t in posted):
        raise RuntimeError(f"a receive of the duty sweep did not complete within {timeout_s} s")
    return {"wire_s": wire_s, "steps": steps, "receives": [(u, lead, t0, t1) for u, lead, (t0, t1) in posted]}


def sweep_rows(sweep: dict, sent_at: list[float], idle_s: float) -> list[dict]:
    """Each step of `duty_sweep` (`sent_at`: the sender's send returns, in order): its utilisation,
    lead (ms), start (from the sweep's first), seconds, wire share, posted share (a receive posted
    and not complete) and time over the idle step. A message is on the wire from the later of its
    receive's posting and its send's return to its completion."""
    if len(sent_at) != len(sweep["receives"]):
        raise RuntimeError(f"the duty sweep posted {len(sweep['receives'])} receives for {len(sent_at)} sends")
    wire = [(max(posted, s), finished) for (_, _, posted, finished), s in zip(sweep["receives"], sent_at)]
    posted = [(p, finished) for _, _, p, finished in sweep["receives"]]
    steps = sweep["steps"]
    if not steps:
        return []
    starts, ends = [t0 for *_, t0, _ in steps], [t1 for *_, t1 in steps]
    shares, posted_shares = step_shares(starts, ends, wire), step_shares(starts, ends, posted)
    return [{"setting": u, "lead_ms": round(lead * 1e3, 3), "start_s": round(t0 - starts[0], 6), "step_s": t1 - t0,
             "share": round(share, 4), "posted": round(p, 4), "over_idle": round((t1 - t0) / idle_s, 4)}
            for (u, lead, t0, t1), share, p in zip(steps, shares, posted_shares)]


def summarise(rows: list[dict], leads: Sequence[float]) -> tuple[str, dict[str, str], str]:
    """The sweep's `busy_share_curve` (from the steps of the first lead), its metadata lines and the
    text to print: per lead, the steps by wire share, each utilisation's summary, and the steps with
    the wire idle and a receive posted for half of them or more."""
    meta, text, curve = {}, [], "1:1"
    for i, lead in enumerate(leads):
        mine = [r for r in rows if r["lead_ms"] == round(lead, 3)]
        tag = "" if i == 0 else f" lead {lead:g}ms"
        bins = share_bins(np.array([r["share"] for r in mine]), np.array([r["over_idle"] for r in mine]))
        if i == 0:
            curve = busy_share_curve(bins)
        meta.update({f"share_bin{tag} {b.label}": f"steps {b.steps} share {b.share:.4f} median {b.median:.4f} "
                     f"mean {b.mean:.4f}" for b in bins})
        summaries = []
        for u in dict.fromkeys(r["setting"] for r in mine):
            meta[f"duty {u:g}{tag}"] = duty_summary([r for r in mine if r["setting"] == u])
            summaries.append(f"u {u:g}: {meta[f'duty {u:g}{tag}']}")
        waiting = [r["over_idle"] for r in mine if r["share"] < SHARE_BINS[0][2] and r["posted"] >= 0.5]
        meta[f"wire idle, posted{tag}"] = (f"steps {len(waiting)} median over idle {statistics.median(waiting):.4f}"
                                           if waiting else "steps 0")
        text.append(f"receives posted {lead:g} ms before their send: " + "; ".join(summaries)
                    + f"\n{format_bins(bins, 'step / idle step')}\n  wire idle, a receive posted: "
                    + meta[f"wire idle, posted{tag}"])
    return curve, meta, "\n".join(text)


def duty_summary(rows: list[dict]) -> str:
    """One setting's steps in a line: how many, their mean shares (wire; posted, where rows have
    it), their median ratio."""
    if not rows:
        return "no steps (budget)"
    posted = f"posted {statistics.fmean(r['posted'] for r in rows):.3f} " if "posted" in rows[0] else ""
    return (f"steps {len(rows)} mean share {statistics.fmean(r['share'] for r in rows):.3f} {posted}"
            f"median over idle {statistics.median(r['over_idle'] for r in rows):.3f}")
