"""How long the P/D front's pipe messages take to reach the decode process while the front is busy
in Python, as it is between its prefill steps (engine/disagg/pipe_sender.py).

`python -m experiments.lab.pipe_latency [--messages 60] [--busy-ms 3] [--idle-ms 8]`

A `PipeSender` on a duplex pipe to a spawned reader; each turn queues one small message (its send
time in it), spins in Python for `--busy-ms` (the front's host time after a prefill step, holding
the interpreter lock), then sleeps `--idle-ms` (the next step's GPU wait, the lock released). The
reader records each message's arrival on the same monotonic clock. Printed per mode, alternated
twice: `thread` (every message written by the sender's thread, as before the direct write), and
`direct` (written from the caller's thread when nothing is queued and the socket takes it), each at
the interpreter's switch interval (5 ms by default) and, with `--switch-ms`, another. A message
queued by a busy caller waits for the thread to get the lock: about `--busy-ms`, up to the switch
interval. A diagnostic: its figures depend on the host's cores and load.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

from engine.disagg.pd_front_transfers import ARRIVING_S
from engine.disagg.pipe_sender import PipeSender


def _reader(conn, n: int, out) -> None:
    lat = []
    for _ in range(n):
        sent = conn.recv()
        lat.append(time.monotonic() - sent)
    out.send(lat)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def latencies(mode: str, n: int, busy_s: float, idle_s: float, switch_s: float) -> list[float]:
    """Milliseconds from `send` to the reader's `recv`, one per message, sorted."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    results, results_in = ctx.Pipe(duplex=False)
    reader = ctx.Process(target=_reader, args=(theirs, n, results_in))
    reader.start()
    sender = PipeSender(ours, f"pipe-latency-{mode}", direct=mode == "direct")
    try:
        time.sleep(0.3)  # the reader is up
        for _ in range(n):
            sender.send(time.monotonic())
            _spin(busy_s)
            time.sleep(idle_s)
        if not results.poll(30.0):
            raise TimeoutError(f"{mode}: the reader did not report within 30 s")
        return sorted(x * 1e3 for x in results.recv())
    finally:
        sender.close(5.0)
        reader.join(5.0)
        if reader.is_alive():
            reader.kill()
        sys.setswitchinterval(before)


def _writer(conn, n: int, every_s: float) -> None:
    for i in range(n):
        time.sleep(every_s * (0.5 + (i * 7919 % 100) / 100))  # spread over the reader's turns
        conn.send(time.monotonic())


def take_latencies(arriving_s: float, n: int, busy_s: float, idle_s: float) -> list[float]:
    """Milliseconds from a message's send (another process) to its `recv` by a caller that spins
    `busy_s` in Python, takes what `PipeReceiver.poll(0, arriving_s)` says is there, sleeps `idle_s`."""
    from engine.disagg.pipe_receiver import PipeReceiver

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(theirs, n, busy_s + idle_s))
    receiver = PipeReceiver(ours, "pipe-latency-receive")
    writer.start()
    lat: list[float] = []
    deadline = time.monotonic() + 60.0
    try:
        while len(lat) < n and time.monotonic() < deadline:
            _spin(busy_s)
            while receiver.poll(0, arriving_s):
                lat.append(time.monotonic() - receiver.recv())
            time.sleep(idle_s)
        return sorted(x * 1e3 for x in lat)
    finally:
        writer.join(5.0)
        if writer.is_alive():
            writer.kill()
        theirs.close()
        receiver.close(5.0)
        ours.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=60)
    ap.add_argument("--busy-ms", type=float, default=3.0)
    ap.add_argument("--idle-ms", type=float, default=8.0)
    ap.add_argument("--switch-ms", type=float, default=None, help="also at this switch interval")
    args = ap.parse_args(argv)
    if args.messages < 1 or args.busy_ms < 0 or args.idle_ms < 0:
        ap.error("--messages must be >= 1 and --busy-ms, --idle-ms >= 0")
    switches = [sys.getswitchinterval()] + ([args.switch_ms / 1e3] if args.switch_ms else [])
    print(f"# sending: {args.messages} messages, each queued before {args.busy_ms} ms of Python and {args.idle_ms} ms "
          "asleep; milliseconds from send to the reader's recv")
    for _ in range(2):
        for switch in switches:
            for mode in ("thread", "direct"):
                lat = latencies(mode, args.messages, args.busy_ms / 1e3, args.idle_ms / 1e3, switch)
                print(f"{mode:6s} switch interval {switch * 1e3:5.2f} ms: median {statistics.median(lat):6.3f} ms, "
                      f"p90 {lat[int(0.9 * (len(lat) - 1))]:6.3f} ms, max {lat[-1]:6.3f} ms")

    print(f"# receiving: {args.messages} messages from another process at random; the caller spins {args.busy_ms} "
          f"ms, takes what is there, sleeps {args.idle_ms} ms; milliseconds from send to the caller's recv")
    for _ in range(2):
        for arriving_s in (0.0, ARRIVING_S):  # without the front's wait, and with it
            lat = take_latencies(arriving_s, args.messages, args.busy_ms / 1e3, args.idle_ms / 1e3)
            print(f"poll(0, arriving_s={arriving_s * 1e3:.0f} ms): {len(lat)} taken, median "
                  f"{statistics.median(lat):6.3f} ms, p90 {lat[int(0.9 * (len(lat) - 1))]:6.3f} ms")


if __name__ == "__main__":
    main()
