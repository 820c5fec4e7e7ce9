"""Timing helpers and device ceilings for the kernel benchmarks (CUDA only).

Kernels are timed by replaying a CUDA graph of many calls (no launch gaps, no host overhead: the
engine captures decode in graphs too).  When one problem's data would fit in L2, the calls rotate
over several copies of the problem so that every call reads from DRAM.
"""

import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

MAX_CALLS_PER_GRAPH = 2000


@dataclass(frozen=True, slots=True)
class RunStamp:
    """Which device a benchmark ran on and when (UTC, to the minute): its CSVs are named by both."""

    device: str
    date: str

    @property
    def tag(self) -> str:
        return f"{self.device.replace(' ', '_')}_{self.date.replace(':', '')}"

    def csv(self, out_dir: str, name: str) -> str:
        return f"{out_dir}/{name}_{self.tag}.csv"

    def csv_writer(self, out_dir: str, name: str, **columns: object) -> Callable[[list[dict]], str]:
        """`save(rows)`: append rows and rewrite the CSV (device and date first, then the rows,
        `columns`, the torch and triton versions), so a run cut short still leaves its numbers;
        returns the CSV's path."""
        import pandas as pd

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        path, rows = self.csv(out_dir, name), []

        def save(new_rows: list[dict]) -> str:
            rows.extend(new_rows)
            table = pd.DataFrame(rows)
            table.insert(0, "device", self.device)
            table.insert(1, "date", self.date)
            for key, value in {**columns, "torch": torch.__version__, "triton": triton.__version__}.items():
                table[key] = value
            table.to_csv(path, index=False)
            return path

        return save


def run_stamp() -> RunStamp:
    """The current device and minute; prints them with the torch and triton versions."""
    stamp = RunStamp(torch.cuda.get_device_name(), datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M"))
    print(f"{stamp.device} | torch {torch.__version__} | triton {triton.__version__} | {stamp.date} UTC")
    return stamp


def l2_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


def copies_for(nbytes: int, max_copies: int = 32) -> int:
    """Problem copies to rotate over so that their data is 3x the L2."""
    return max(1, min(max_copies, -(-3 * l2_bytes() // max(nbytes, 1))))


def graph_ms(fns: list[Callable[[], object]], target_ms: float = 50.0) -> float:
    """Median time of one call, from replays of a graph calling fns round-robin."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile and warm up outside the capture
            fn()
        stream.synchronize()
        once = torch.cuda.CUDAGraph()
        with torch.cuda.graph(once, stream=stream):
            for fn in fns:
                fn()
        est = _replay_ms(once, 3) / len(fns)
        rounds = max(1, min(int(target_ms / max(est * len(fns), 1e-3)), MAX_CALLS_PER_GRAPH // len(fns)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(rounds):
                for fn in fns:
                    fn()
        per_call = [_replay_ms(graph, 1) / (rounds * len(fns)) for _ in range(7)]
    del once, graph
    return statistics.median(per_call)


def _replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()  # warm
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def bench_ms(fn: Callable[[], object], rep: int = 100) -> float:
    """Event timing with L2 flushes (triton's do_bench), for code that cannot be captured."""
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def wall_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median wall time of fn() including a device sync (for ops that involve the host)."""
    times = []
    for i in range(reps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_gbps() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read + written."""
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.nbytes / do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median") / 1e6


def matmul_tflops() -> float:
    """8192^3 bf16 matrix product on random data."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median") / 1e9
