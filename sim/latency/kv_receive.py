"""What a KV message costs the two engines beside the link itself, for the simulated prefill/decode
pair (sim/fleet/kv_messages.py; docs/disaggregation.md, "What a receive costs beside the link"):

- `scatter_s(bytes)`: the decode side's scatter of a received message into its blocks (one launch
  on the compute stream, between the step in flight and the next: device time the next step waits
  for);
- `send_host_s(bytes)`: the prefill side's host time to post a message (staging buffer, gather
  launch, the send call) on the loop that runs its steps;
- the busy-share curve: a decode step while KV bytes are on the wire into its GPU for a share `s`
  of it takes `busy_factor(s)` times its price (NCCL's receive kernels beside the forward, the
  link's waiter thread polling them, the loop polling the link): piecewise linear through the
  measured points `(share, factor)`, 1.0 at share 0, the last point's factor beyond it;
- the send-side curve: a prefill step while the KV bytes it sends are on the wire for a share `s`
  of it takes `send_busy_factor(s)` times its price (the gather into the staging buffer and NCCL's
  send kernel on the link's side stream beside the forward), the same kind of curve;
- `send_beside_s(bytes)`: what a message's gather loses beside a running prefill step, the other
  way round: its thread blocks wait for the forward's to leave room on the GPU's SMs, so a message
  whose turn on the link comes during a step starts its bytes that much later than one on an idle
  GPU (the link's own price). Linear between the measured sizes, the nearest size's figure
  outside them; 0 without points.

Where the figures come from (`load_kv_receive`):
- a receive profile, the CSV `experiments.bench_kv_receive` writes on two GPUs: `# key: value`
  metadata (`model`, `device`, `busy_share_curve` ...) and rows `blocks,bytes,scatter_s,send_host_s`
  (medians per message size); a size between rows is interpolated linearly in bytes, one past the
  largest extended along the last segment. `busy_share_curve` is `share:factor` pairs, space
  separated, shares in (0, 1] ascending, factors >= 1 (the bench's duty-cycle sweep; `1:1` prices
  no busy link). `send_busy_share_curve`, optional and of the same syntax, is the send-side
  sweep's (a file without it: no send-side price, factor 1). `send_beside_step`, optional, is
  `bytes:seconds` pairs, bytes ascending (`python -m experiments.lab.send_beside_step` on one GPU;
  a file without it: 0). `busy_step_factor` is what it always was, the step beside back-to-back
  receives (the link saturated) over the idle step: a record, not a price. A file without
  `busy_share_curve` (format 1, written before the sweep) is refused, naming the field;
- `hardware`: the scatter alone, at the device's copy rate (`hbm_bandwidth` of conf/hardware, a
  copy's read and write: 2 x bytes / hbm_bandwidth); no send time, no busy-link price.
"""
from __future__ import annotations

import bisect
import csv
import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from sim.latency.file_meta import read_meta, text_lines

COLUMNS = ("blocks", "bytes", "scatter_s", "send_host_s")
HARDWARE = "hardware"
CURVE_KEY = "busy_share_curve"
SEND_CURVE_KEY = "send_busy_share_curve"  # optional: a prefill step priced by its outgoing link's share
SEND_BESIDE_KEY = "send_beside_step"  # optional: a gather slowed by a running prefill step
FORMAT = 2  # 2: `busy_share_curve` prices a step by the share of it the wire is busy


@dataclass(slots=True, frozen=True)
class KVReceivePrice:
    """Piecewise-linear prices over message bytes (`bytes_at` ascending, the seconds of each price
    at those sizes), the busy-share curve (`busy_share_at` ascending in (0, 1], the factor at
    each; none: no busy-link price) and the send side's (`send_busy_share_at`, the same rules);
    `source` says where they come from (a file, or the hardware's copy rate), `model` what it was
    measured on."""

    bytes_at: tuple[float, ...]
    scatter_at: tuple[float, ...]
    send_host_at: tuple[float, ...]
    busy_share_at: tuple[float, ...] = ()
    busy_factor_at: tuple[float, ...] = ()
    source: str = ""
    send_busy_share_at: tuple[float, ...] = ()
    send_busy_factor_at: tuple[float, ...] = ()
    model: str | None = None  # the model the profile was measured on (its `# model:` line; None: any)
    send_beside_bytes_at: tuple[float, ...] = ()
    send_beside_s_at: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.bytes_at)
        if n < 2 or len(self.scatter_at) != n or len(self.send_host_at) != n:
            raise ValueError(f"{self.source}: a receive price needs at least two sizes, each with a scatter "
                             "and a send time")
        if any(b <= a for a, b in zip(self.bytes_at, self.bytes_at[1:])):
            raise ValueError(f"{self.source}: message sizes must be distinct and ascending, got {self.bytes_at}")
        for name, values in (("scatter_s", self.scatter_at), ("send_host_s", self.send_host_at)):
            if any(not (0 <= v < math.inf) for v in values):
                raise ValueError(f"{self.source}: {name} values must be seconds >= 0, got {values}")
        _check_curve(self.source, CURVE_KEY, self.busy_share_at, self.busy_factor_at)
        _check_curve(self.source, SEND_CURVE_KEY, self.send_busy_share_at, self.send_busy_factor_at)
        at, secs = self.send_beside_bytes_at, self.send_beside_s_at
        points = f"{SEND_BESIDE_KEY}={' '.join(f'{a:g}:{b:g}' for a, b in zip(at, secs))!r}"
        if len(secs) != len(at) or any(not 0 < a < math.inf for a in at) \
                or any(b <= a for a, b in pairwise(at)):
            raise ValueError(f"{self.source}: {points} is invalid: message sizes in bytes > 0, ascending, "
                             "one figure each")
        if any(not 0 <= v < 1.0 for v in secs):
            raise ValueError(f"{self.source}: {points} is invalid: seconds in [0, 1)")

    def scatter_s(self, nbytes: float) -> float:
        return _interpolate(self.bytes_at, self.scatter_at, nbytes)

    def send_host_s(self, nbytes: float) -> float:
        return _interpolate(self.bytes_at, self.send_host_at, nbytes)

    def send_beside_s(self, nbytes: float) -> float:
        """What a message of `nbytes` whose turn comes during a prefill step loses to it (module
        docstring)."""
        at = self.send_beside_bytes_at
        if not at:
            return 0.0
        if len(at) == 1 or nbytes <= at[0]:
            return self.send_beside_s_at[0]
        if nbytes >= at[-1]:
            return self.send_beside_s_at[-1]
        return _interpolate(at, self.send_beside_s_at, nbytes)

    @property
    def prices_busy_link(self) -> bool:
        return any(f != 1.0 for f in self.busy_factor_at)

    @property
    def prices_send_busy_link(self) -> bool:
        return any(f != 1.0 for f in self.send_busy_factor_at)

    def busy_factor(self, share: float) -> float:
        """A decode step's price multiplier with the wire busy for `share` of it: 1.0 at 0, linear
        between the curve's points, the last point's factor past it."""
        return _curve_factor(self.busy_share_at, self.busy_factor_at, share)

    def send_busy_factor(self, share: float) -> float:
        """A prefill step's multiplier with the bytes it sends on the wire for `share` of it (as
        `busy_factor`; 1.0 without a send-side curve)."""
        return _curve_factor(self.send_busy_share_at, self.send_busy_factor_at, share)


def _check_curve(source: str, key: str, shares: tuple[float, ...], factors: tuple[float, ...]) -> None:
    curve = f"{key}={' '.join(f'{a:g}:{b:g}' for a, b in zip(shares, factors))!r}"
    if len(factors) != len(shares):
        raise ValueError(f"{source}: {curve} is invalid: one factor per share")
    if any(not 0 < a <= 1 for a in shares) or any(b <= a for a, b in pairwise(shares)):
        raise ValueError(f"{source}: {curve} is invalid: shares must be ascending in (0, 1]")
    if any(not 1.0 <= f < 10.0 for f in factors):
        raise ValueError(f"{source}: {curve} is invalid: factors must be numbers in [1, 10) "
                         "(1: a step beside the wire costs its price)")


def _curve_factor(shares: tuple[float, ...], factors: tuple[float, ...], share: float) -> float:
    """A curve's factor at `share`: 1.0 at 0 or without points, linear between them, the last
    point's factor past it."""
    if share <= 0 or not shares:
        return 1.0
    shares, factors = (0.0, *shares), (1.0, *factors)
    if share >= shares[-1]:
        return factors[-1]
    return _interpolate(shares, factors, share)


def wire_share(start: float, end: float, intervals: Iterable[tuple[float, float]]) -> float:
    """The share of [start, end] that the union of `intervals` ((begin, end) pairs) covers."""
    if end <= start:
        return 0.0
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered / (end - start)


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """ys at x, linear between points, along the first or last segment outside them, never below 0."""
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def hardware_price(hbm_bandwidth: float, name: str = "hardware") -> KVReceivePrice:
    """The scatter at the device's copy rate (a copy reads and writes each byte), nothing else."""
    if not (isinstance(hbm_bandwidth, (int, float)) and 0 < hbm_bandwidth < math.inf):
        raise ValueError(f"{name}: hbm_bandwidth={hbm_bandwidth!r} is invalid: bytes per second > 0")
    return KVReceivePrice((0.0, 1e9), (0.0, 2e9 / hbm_bandwidth), (0.0, 0.0), source=f"{name} copy rate {hbm_bandwidth / 1e12:.2f} TB/s")


def read_receive_profile(path: str | Path) -> KVReceivePrice:
    """A receive profile (module docstring); raises ValueError naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cluster.kv_receive_profile={str(path)!r}: no such file (write one with "
                         "`python -m experiments.bench_kv_receive --out ...` on two GPUs, or use 'hardware')")
    lines = list(text_lines(path))
    # Metadata lines anywhere in the file (a line appended to an old profile counts: parse_curve).
    meta, _ = read_meta([line for line in lines if line.startswith("#")])
    rows = list(csv.DictReader(line for line in lines if line.strip() and not line.startswith("#")))
    if not rows or any(c not in rows[0] for c in COLUMNS):
        raise ValueError(f"{path}: a receive profile needs the columns {', '.join(COLUMNS)}")
    try:
        points = sorted((float(r["bytes"]), float(r["scatter_s"]), float(r["send_host_s"])) for r in rows)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    shares, factors = parse_curve(meta, path)
    send_shares, send_factors = parse_curve(meta, path, SEND_CURVE_KEY)
    beside_at, beside_s = _pairs(meta[SEND_BESIDE_KEY], SEND_BESIDE_KEY, path, "bytes:seconds") \
        if SEND_BESIDE_KEY in meta else ((), ())
    if SEND_BESIDE_KEY in meta and not beside_at:
        raise ValueError(f"{path}: {SEND_BESIDE_KEY} is empty: `bytes:seconds` pairs (or no such line)")
    return KVReceivePrice(tuple(p[0] for p in points), tuple(p[1] for p in points), tuple(p[2] for p in points),
                          shares, factors, str(path), send_shares, send_factors, meta.get("model"),
                          beside_at, beside_s)


def parse_curve(meta: dict[str, str], path: Path, key: str = CURVE_KEY) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The curve `key` of a profile's metadata as (shares, factors): `busy_share_curve` is required,
    `send_busy_share_curve` optional (missing: no points, no price)."""
    if key != CURVE_KEY and key not in meta:
        return (), ()
    if key not in meta:
        raise ValueError(
            f"{path}: no {CURVE_KEY} (a receive profile of format 1: its busy_step_factor="
            f"{meta.get('busy_step_factor', '-')} was measured with the link saturated and does not price a "
            "step by the share of it the wire is busy); re-measure with `python -m experiments.bench_kv_receive`, "
            f"or add the line `# {CURVE_KEY}: 1:1` to price its scatter and send times alone")
    shares, factors = _pairs(meta[key], key, path, "share:factor")
    if not shares:
        raise ValueError(f"{path}: {key} is empty: `share:factor` pairs (`1:1`: no busy-link price)")
    return shares, factors


def _pairs(text: str, key: str, path: Path, form: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`a:b` pairs, space separated, as two tuples; a ValueError naming the key and the bad pair."""
    left, right = [], []
    for pair in text.split():
        a, sep, b = pair.partition(":")
        try:
            left.append(float(a))
            right.append(float(b))
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"{path}: {key}={text!r} is invalid: `{form}` pairs, space separated "
                             f"(got {pair!r})")
    return tuple(left), tuple(right)


def write_receive_profile(path: str | Path, meta: dict[str, object], rows: list[dict[str, float]]) -> None:
    """The bench's output: `meta` as `# key: value` lines, then the COLUMNS of each row."""
    with open(path, "w", newline="") as f:
        for key, value in meta.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row[c] for c in COLUMNS})


def load_kv_receive(setting: str | None, hbm_bandwidth: float) -> KVReceivePrice | None:
    """`cluster.kv_receive_profile`: None (off), 'hardware' or a receive profile's path."""
    if setting is None:
        return None
    if not isinstance(setting, str) or not setting:
        raise ValueError(f"cluster.kv_receive_profile={setting!r} is invalid: null, '{HARDWARE}' or a CSV path")
    if setting == HARDWARE:
        return hardware_price(hbm_bandwidth)
    return read_receive_profile(setting)
