"""What a KV message costs the two engines beside the link itself, for the simulated prefill/decode
pair (sim/fleet/disagg.py; docs/disaggregation.md, "What a receive costs beside the link"):

- `scatter_s(bytes)`: the decode side's scatter of a received message into its blocks (one launch
  on the compute stream, between the step in flight and the next: device time the next step waits
  for);
- `send_host_s(bytes)`: the prefill side's host time to post a message (staging buffer, gather
  launch, the send call) on the loop that runs its steps;
- `busy_step_factor`: a decode step that runs while a receive into its GPU is posted and not done
  takes this many times its price (NCCL's receive kernels beside the forward, the link's waiter
  thread polling them, the loop polling the link).

Where the figures come from (`load_kv_receive`):
- a receive profile, the CSV `experiments.bench_kv_receive` writes on two GPUs: `# key: value`
  metadata (`model`, `device`, `busy_step_factor` ...) and rows `blocks,bytes,scatter_s,send_host_s`
  (medians per message size); a size between rows is interpolated linearly in bytes, one past the
  largest extended along the last segment;
- `hardware`: the scatter alone, at the device's copy rate (`hbm_bandwidth` of conf/hardware, a
  copy's read and write: 2 x bytes / hbm_bandwidth); no send time, factor 1.
"""
from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ("blocks", "bytes", "scatter_s", "send_host_s")
HARDWARE = "hardware"


@dataclass(slots=True, frozen=True)
class KVReceivePrice:
    """Piecewise-linear prices over message bytes (`bytes_at` ascending, the seconds of each price
    at those sizes) and the busy-link factor; `source` says where they come from (a file, or the
    hardware's copy rate)."""

    bytes_at: tuple[float, ...]
    scatter_at: tuple[float, ...]
    send_host_at: tuple[float, ...]
    busy_step_factor: float = 1.0
    source: str = ""

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
        if not (isinstance(self.busy_step_factor, (int, float)) and 1.0 <= self.busy_step_factor < 10.0):
            raise ValueError(f"{self.source}: busy_step_factor={self.busy_step_factor!r} is invalid: "
                             "a number >= 1 (1: a step beside a receive costs its price)")

    def scatter_s(self, nbytes: float) -> float:
        return _interpolate(self.bytes_at, self.scatter_at, nbytes)

    def send_host_s(self, nbytes: float) -> float:
        return _interpolate(self.bytes_at, self.send_host_at, nbytes)

    def busy_surcharge_s(self, step_s: float, start: float, receives) -> float:
        """Seconds a step of price `step_s` starting at `start` gains from the receives posted on
        its GPU (`receives`: their (posted, done) pairs): `(busy_step_factor - 1)` x the step's price
        over the share of it the receives overlap."""
        if self.busy_step_factor == 1.0 or step_s <= 0 or not receives:
            return 0.0
        end, covered, reach = start + step_s, 0.0, start
        for a, b in sorted(receives):
            a, b = max(a, reach), min(b, end)
            if b > a:
                covered += b - a
                reach = b
        return (self.busy_step_factor - 1.0) * covered


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """ys at x, linear between points, along the first or last segment outside them, never below 0."""
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def hardware_price(hbm_bandwidth: float, name: str = "hardware") -> KVReceivePrice:
    """The scatter at the device's copy rate (a copy reads and writes each byte), nothing else."""
    if not (isinstance(hbm_bandwidth, (int, float)) and 0 < hbm_bandwidth < math.inf):
        raise ValueError(f"{name}: hbm_bandwidth={hbm_bandwidth!r} is invalid: bytes per second > 0")
    return KVReceivePrice((0.0, 1e9), (0.0, 2e9 / hbm_bandwidth), (0.0, 0.0), 1.0,
                          f"{name} copy rate {hbm_bandwidth / 1e12:.2f} TB/s")


def read_receive_profile(path: str | Path) -> KVReceivePrice:
    """A receive profile (module docstring); raises ValueError naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cluster.kv_receive_profile={str(path)!r}: no such file (write one with "
                         "`python -m experiments.bench_kv_receive --out ...` on two GPUs, or use 'hardware')")
    meta: dict[str, str] = {}
    lines = path.read_text().splitlines()
    body = []
    for line in lines:
        if line.startswith("#"):
            key, sep, value = line[1:].partition(":")
            if sep:
                meta[key.strip()] = value.strip()
        elif line.strip():
            body.append(line)
    rows = list(csv.DictReader(body))
    if not rows or any(c not in rows[0] for c in COLUMNS):
        raise ValueError(f"{path}: a receive profile needs the columns {', '.join(COLUMNS)}")
    try:
        points = sorted((float(r["bytes"]), float(r["scatter_s"]), float(r["send_host_s"])) for r in rows)
        factor = float(meta.get("busy_step_factor", "1"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return KVReceivePrice(tuple(p[0] for p in points), tuple(p[1] for p in points), tuple(p[2] for p in points),
                          factor, str(path))


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
