"""Where a disaggregated pair's answer waits between the decode side's reservation and the front's
send (a hand-off's `link_wait`): `experiments.lab.front_parts` records, for every `Reserved` the
front acts on, when its pipe's reader thread saw the message (`PipeReceiver.last_arrival`: the
thread needs the interpreter lock to see it) and when the front posted the send, on the front's
clock; the trace gives the reservation. So each answer's wait splits into

- `to_reader`: the reservation to the reader thread seeing the bytes (the decode side's send, the
  pipe, and the reader's wait for the interpreter lock while the front's thread runs Python);
- `to_post`: the reader's queue to the front's send (the front's loop taking the message: at once
  while it polls during a prefill step, at its next turn between steps).

`mid_step`: the front took it while waiting for a prefill step (`_while_prefilling`), not at a turn.
A diagnostic for the simulator's hop between the two loops (sim/fleet/front_host.py `hop_s`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from experiments.lib.kv_receive_duty import prefill_ends


@dataclass(slots=True)
class AnswerLog:
    """One front's answers, in the order it acted on them: request ids, and seconds on its clock."""

    request_ids: list[tuple[str, ...]] = field(default_factory=list)
    seen_s: list[float] = field(default_factory=list)
    posted_s: list[float] = field(default_factory=list)
    mid_step: list[bool] = field(default_factory=list)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({"request_id": [ids[0] for ids in self.request_ids],
                             "requests": [len(ids) for ids in self.request_ids],
                             "seen_s": self.seen_s, "posted_s": self.posted_s, "mid_step": self.mid_step})


def watch_answers(engine) -> AnswerLog:
    """Record every `Reserved` the front `engine` (a `DisaggregatedEngine`) acts on, from now."""
    log = AnswerLog()
    start = engine._start_transfer
    receiver = engine._receiver

    def timed(message, mid_step: bool = False):
        posted = engine.now()
        arrival = getattr(receiver, "last_arrival", None)
        seen = posted - (time.monotonic() - arrival) if arrival is not None else float("nan")
        log.request_ids.append(tuple(message.request_ids))
        log.seen_s.append(seen)
        log.posted_s.append(posted)
        log.mid_step.append(bool(mid_step))
        return start(message, mid_step=mid_step)

    engine._start_transfer = timed
    return log


def answer_split(answers: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """`answers` (`AnswerLog.frame`) with each answer's wait from the reservation of its first
    request (its prefill's end, `kv_receive_duty.prefill_ends`, plus its `decode_wait`):
    `link_wait` and its parts `to_reader` and `to_post` (seconds). Not the trace's own `link_wait`,
    which the decode side takes as 0 when the front's start message comes after the KV."""
    rows = requests.set_index("request_id")
    d = answers[answers["request_id"].isin(rows.index)].copy()
    first = rows.loc[d["request_id"]]
    reserved = (prefill_ends(first) + first["decode_wait"]).to_numpy(dtype=float)
    d["link_wait"] = d["posted_s"] - reserved
    d["to_post"] = d["posted_s"] - d["seen_s"]
    d["to_reader"] = d["seen_s"] - reserved
    return d


def format_split(name: str, d: pd.DataFrame) -> str:
    lines = [f"## {name}: {len(d)} answers; milliseconds (mean, p90): link_wait = to_reader + to_post"]
    for label, rows in (("during a prefill step", d[d["mid_step"]]), ("at a turn of the loop", d[~d["mid_step"]])):
        if not len(rows):
            continue
        stats = ", ".join(f"{c} {rows[c].mean() * 1e3:.2f} / {np.percentile(rows[c], 90) * 1e3:.2f}"
                          for c in ("link_wait", "to_reader", "to_post"))
        lines.append(f"  {label:24s} {len(rows):5d}: {stats}")
    return "\n".join(lines)
