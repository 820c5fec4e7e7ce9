"""Where an engine run's decode-only steps go over a step profile's price of their shapes.

`python -m experiments.lab.decode_excess --runs DIR --profile CSV [--scenarios a,b]` reads each
scenario's `DIR/<scenario>/engine/steps.parquet` (and `requests.parquet` for the KV link's busy
intervals) and prints, per replica that decodes (a disaggregated pair's prefill engine, replica 0
of a run with hand-offs, is left out), its decode-only steps' excess over the profile split by what
the step rows tell apart:

- a step's period is the time to the same replica's next step (as the fidelity report's step
  table); its price the profile's `time_s` (scheduled ahead) of (decodes, context), as
  `experiments.fidelity`'s `decode_vs_profile` prices it;
- scheduled ahead or not: a step scheduled ahead starts at its predecessor's update
  (policies/lookahead.py: `time` = the previous row's `time + duration`); one that is not starts
  after it, the gap being the host's work between the update and the schedule. A synchronous
  step's period is schedule to update, priced from the profile's `sync_time_s`;
- `sync`: the steps not scheduled ahead, against their synchronous price; `pipeline break`: their
  synchronous price over the ahead price (what the simulator charges them too, where its replica
  breaks the same way: the scheduler is the same);
- `before sync`: the scheduled-ahead steps right before a synchronous one (the loop iteration that
  broke the pipeline: on a decode engine a receive's scatter and take-over), their host gap apart;
- `ahead, link busy` / `ahead, link idle`: the other scheduled-ahead steps, by whether a KV receive
  was on the wire (a request's `transfer_time - link_time` after its prefill ended, to the end of
  its transfer) while they ran; with `--busy-from posted`, from its reservation (`decode_wait`
  after its prefill ended: the decode engine posts the receive then).

`--by-share` also prints the scheduled-ahead steps not before a synchronous one (the two `ahead`
classes) grouped by the share of their period a receive was on the wire (the union of the
requests' intervals above, counted from the send, the simulator's rule; with `--busy-from posted`,
from the posting: the share a receive was posted and not done; `experiments/lib/kv_receive_duty.py`'s
bins), with their period over their ahead price: the engine's side of
`experiments.bench_kv_receive`'s `busy_share_curve`, whose ratio is a step over the idle step. An
engine interval ends when the decode loop notices the receive (`link_time`), up to a step after
its last byte, so the engine's shares read high by up to that.

A profile's decode rows are engine step periods at real batch sizes (experiments/profile.py); the
CUDA graph a step runs is padded to the next graph size (`padded` shows what pricing that size
instead would add).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from engine.device.cuda_graph import graph_batch_sizes
from experiments.lib.kv_receive_duty import format_bins, share_bins, step_shares, wire_intervals

Price = Callable[[int, int, bool], float]  # (decodes, context tokens, synchronous) -> seconds
CLASSES = ("sync", "pipeline break", "before sync: host gap", "before sync: rest", "ahead, link busy",
           "ahead, link idle")


def decode_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """One replica's steps (in step order) with `period`, `gap` (host time before the step, 0 when
    scheduled ahead), `ahead`, and `before_sync` (the next step is not scheduled ahead); decode-only
    steps with a predecessor and a successor only, and none that leaves the replica empty (its
    period holds the idle time to the next request)."""
    d = steps.sort_values("step").reset_index(drop=True)
    end = d["time"] + d["duration"]
    gap = (d["time"] - end.shift(1)).fillna(np.inf)
    d["ahead"] = gap <= 1e-9
    d["gap"] = gap.where(~d["ahead"], 0.0).replace(np.inf, 0.0)
    d["period"] = d["time"].shift(-1) - d["time"]
    d["before_sync"] = ~d["ahead"].shift(-1, fill_value=True)
    d["next_gap"] = d["gap"].shift(-1, fill_value=0.0)
    keep = ((d["num_prefill_tokens"] == 0) & (d["num_decode_seqs"] > 0) & d["period"].notna()
            & (d.index > 0) & (d["num_running"] > d["num_finished"]))
    for column in ("num_swap_out_blocks", "num_swap_in_blocks"):
        if column in d.columns:
            keep &= d[column] == 0
    return d[keep].reset_index(drop=True)


def wire_shares(d: pd.DataFrame, requests: pd.DataFrame | None, posted: bool = False) -> np.ndarray:
    """Per step: the share of its period a KV receive was on the wire (`posted`: posted and not done)."""
    t0 = d["time"].to_numpy(dtype=float)
    return step_shares(t0, t0 + d["period"].to_numpy(dtype=float), wire_intervals(requests, posted))


def link_busy(d: pd.DataFrame, requests: pd.DataFrame | None, posted: bool = False) -> np.ndarray:
    """Per step: whether a KV receive was on the wire (`posted`: posted and not done) at some point
    of its period."""
    return wire_shares(d, requests, posted) > 0


def by_share(d: pd.DataFrame, price: Price, shares: np.ndarray) -> str:
    """The scheduled-ahead steps not before a synchronous one, by wire share: period over ahead price."""
    rest = (d["ahead"] & ~d["before_sync"]).to_numpy()
    n, c = d["num_decode_seqs"].to_numpy(dtype=int), d["kv_tokens"].to_numpy(dtype=int)
    ratio = d["period"].to_numpy(dtype=float) / np.array([price(a, b, False) for a, b in zip(n, c)])
    return format_bins(share_bins(shares[rest], ratio[rest]), "period / price")


def split_excess(d: pd.DataFrame, price: Price, busy: np.ndarray | None = None) -> dict[str, float]:
    """Seconds of the steps' periods over their ahead price, by class (module docstring), with
    `total`, `steps`, `period_s`, `price_s` (sums) and `padded` (pricing the padded batch)."""
    n, c = d["num_decode_seqs"].to_numpy(dtype=int), d["kv_tokens"].to_numpy(dtype=int)
    ahead_price = np.array([price(a, b, False) for a, b in zip(n, c)])
    sync_price = np.array([price(a, b, True) for a, b in zip(n, c)])
    sizes = graph_batch_sizes(max(256, int(n.max(initial=1))))
    pad = np.array([price(next(s for s in sizes if s >= a), b, False) for a, b in zip(n, c)])
    period = d["period"].to_numpy(dtype=float)
    ahead, before = d["ahead"].to_numpy(), d["before_sync"].to_numpy() & d["ahead"].to_numpy()
    busy = np.zeros(len(d), dtype=bool) if busy is None else busy
    host_gap = d["next_gap"].to_numpy(dtype=float)
    rest = ahead & ~before
    out = {
        "sync": float((period - sync_price)[~ahead].sum()),
        "pipeline break": float((sync_price - ahead_price)[~ahead].sum()),
        "before sync: host gap": float(host_gap[before].sum()),
        "before sync: rest": float((period - host_gap - ahead_price)[before].sum()),
        "ahead, link busy": float((period - ahead_price)[rest & busy].sum()),
        "ahead, link idle": float((period - ahead_price)[rest & ~busy].sum()),
    }
    counts = {"sync": ~ahead, "before sync": before, "ahead, link busy": rest & busy, "ahead, link idle": rest & ~busy}
    out.update({f"n {k}": float(m.sum()) for k, m in counts.items()})
    out.update(total=float((period - ahead_price).sum()), steps=float(len(d)), period_s=float(period.sum()),
               price_s=float(ahead_price.sum()), padded=float((pad - ahead_price).sum()))
    return out


def profile_price(path: str | Path, block_size: int = 16) -> Price:
    from sim.latency.profiled import ProfiledModel

    model = ProfiledModel(str(path), block_size)
    if model.sync_grid is None:
        raise ValueError(f"{path}: no sync_time_s column: a profile taken with async scheduling is needed "
                         "to price steps not scheduled ahead")
    return lambda n, c, sync: model.lookup(0, n, c, model.sync_grid if sync else None)


def report(name: str, replica: int, s: dict[str, float]) -> str:
    lines = [f"{name} replica {replica}: {int(s['steps'])} decode-only steps, {s['period_s'] * 1e3:.0f} ms against "
             f"{s['price_s'] * 1e3:.0f} ms priced ({s['period_s'] / s['price_s']:.3f}x), excess {s['total'] * 1e3:.0f} ms"]
    for k in CLASSES:
        count = s.get(f"n {k.split(':')[0]}")
        steps = f" ({int(count)} steps)" if count is not None else ""
        lines.append(f"  {k:24s} {s[k] * 1e3:7.0f} ms {s[k] / s['total']:6.0%}{steps}" if s["total"] else
                     f"  {k:24s} {s[k] * 1e3:7.0f} ms{steps}")
    lines.append(f"  (graph padding priced: {s['padded'] * 1e3:+.0f} ms)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, help="a fidelity --runs directory (<scenario>/engine/steps.parquet)")
    p.add_argument("--profile", required=True, help="the step profile (with sync_time_s)")
    p.add_argument("--scenarios", default="", help="comma-separated; default every scenario with engine steps")
    p.add_argument("--busy-from", choices=("sent", "posted"), default="sent",
                   help="a receive makes the link busy from its send (default) or from its posting")
    p.add_argument("--by-share", action="store_true",
                   help="also the scheduled-ahead steps by the share of their period the wire was busy")
    a = p.parse_args(argv)
    root, price = Path(a.runs), profile_price(a.profile)
    names = a.scenarios.split(",") if a.scenarios else sorted(x.parent.parent.name for x in root.glob("*/engine/steps.parquet"))
    if not names:
        raise SystemExit(f"--runs {root}: no <scenario>/engine/steps.parquet there")
    for name in names:
        path = root / name / "engine" / "steps.parquet"
        if not path.exists():
            raise SystemExit(f"--scenarios: {name} has no {path}")
        steps = pd.read_parquet(path)
        req_path = path.with_name("requests.parquet")
        requests = pd.read_parquet(req_path) if req_path.exists() else None
        split = requests is not None and requests.get("decode_replica", pd.Series(dtype=float)).notna().any()
        for replica, rows in steps.groupby("replica"):
            if split and replica == 0:
                continue  # the pair's prefill engine
            d = decode_steps(rows)
            if not len(d):
                continue
            on_link = requests if split else None
            shares = wire_shares(d, on_link, a.busy_from == "posted")
            print(report(name, int(replica), split_excess(d, price, shares > 0)))
            if a.by_share:  # by the share counted as above: from the send, or from the posting
                what = "the wire was busy" if a.busy_from == "sent" else "a receive was posted and not done"
                print(f"  ahead steps (not before sync) by the share of their period {what}:\n"
                      + by_share(d, price, shares))


if __name__ == "__main__":
    main()
