"""Scheduler CPU cost per decode step: `python -m experiments.bench_scheduler [--profile]`.

256 running sequences (block_size 16, prompts of 768-1024 random tokens, so contexts ~1k-2k over the
measured steps), steady decode: every step schedules 256 one-token decodes and `update` appends 256
tokens, with trace recording on. The CPU time (`time.thread_time_ns`) of `schedule()` + `update()` is
taken per step; building the fake sampled tokens (the backend's job) is not counted.
Target: median <= 150 us per step, i.e. < 2% of a ~5-10 ms decode step on an H200.
`--policy` measures another policy (requests carry one of four tenants, for vtc; sjf and srpt
predict from max_tokens); `--waiting N` adds N requests that wait behind the full running queue
(max_num_seqs), so that every step also reads the waiting queue's order.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import random
import statistics
import time

from experiments.lib.cli import check_at_least
from policies import Request, SamplingParams, Scheduler, SchedulerConfig, make_block_manager, make_policy
from policies.blocks import BLOCK_MANAGERS


def build(kind: str, num_seqs: int, block_size: int, seed: int, policy: str = "fcfs",
          num_waiting: int = 0) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=num_seqs, max_model_len=4096)
    blocks = make_block_manager(kind, block_size, num_gpu_blocks=(num_seqs + num_waiting) * 4096 // block_size,
                                num_cpu_blocks=0, watermark=0.01, max_model_len=4096)
    scheduler = Scheduler(config, make_policy(policy), blocks)
    rng = random.Random(seed)
    for i in range(num_seqs + num_waiting):
        prompt = [rng.randint(0, 10_000) for _ in range(rng.randint(768, 1024))]
        params = SamplingParams(max_tokens=rng.randint(2000, 3000), ignore_eos=True)
        scheduler.add(Request(f"r{i}", prompt, params, arrival_time=i * 1e-3, tenant=f"t{i % 4}"), now=0.0)
    now = 0.0
    while scheduler.num_waiting > num_waiting or any(s.is_prefill for s in scheduler.queues.running):
        out = scheduler.schedule(now)
        now += 0.01
        scheduler.update(out, fake_tokens(out, rng), now)
    return scheduler


def fake_tokens(out, rng: random.Random) -> dict[int, list[int]]:
    token = rng.randint(0, 10_000)
    return {entry.seq.seq_id: [token] * entry.num_samples for entry in out.scheduled if entry.num_samples}


def measure(scheduler: Scheduler, num_steps: int, seed: int) -> tuple[list[float], list[float]]:
    """Per-step CPU microseconds of schedule() and of update()."""
    rng = random.Random(seed)
    clock = time.thread_time_ns
    now, schedule_us, update_us = 1_000.0, [], []
    for _ in range(num_steps):
        t0 = clock()
        out = scheduler.schedule(now)
        t1 = clock()
        tokens = fake_tokens(out, rng)
        now += 0.01
        t2 = clock()
        scheduler.update(out, tokens, now)
        t3 = clock()
        schedule_us.append((t1 - t0) / 1_000)
        update_us.append((t3 - t2) / 1_000)
    return schedule_us, update_us


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=BLOCK_MANAGERS.names(), choices=BLOCK_MANAGERS.names(),
                        help="block managers to time (default: every registered one)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="fresh schedulers per kind; all steps pooled")
    parser.add_argument("--policy", default="fcfs", help="a registered policy (default fcfs)")
    parser.add_argument("--waiting", type=int, default=0, help="requests waiting behind the running queue")
    parser.add_argument("--profile", action="store_true", help="cProfile one run per kind instead")
    args = parser.parse_args(argv)
    check_at_least(parser, ("--num-seqs", args.num_seqs, 1), ("--block-size", args.block_size, 1),
                   ("--steps", args.steps, 1), ("--repeats", args.repeats, 1), ("--waiting", args.waiting, 0))
    if not args.profile and args.steps * args.repeats < 2:
        parser.error(f"--steps={args.steps} with --repeats={args.repeats} is invalid: the p99 needs at least 2 "
                     "timed steps in all")
    try:
        make_policy(args.policy)
    except ValueError as exc:
        parser.error(f"--{exc}")
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, load average "
          f"{os.getloadavg()[0]:.1f}; {args.num_seqs} running seqs, block_size {args.block_size}, "
          f"{args.steps} decode steps x {args.repeats}, policy {args.policy}, {args.waiting} waiting; CPU time of "
          "schedule() + update() per step")
    print(f"{'blocks':<10} {'median_us':>10} {'p99_us':>8} {'mean_us':>8} {'us/seq':>7} "
          f"{'schedule_med':>12} {'update_med':>10}")
    for kind in args.kinds:
        if args.profile:
            scheduler = build(kind, args.num_seqs, args.block_size, 0, args.policy, args.waiting)
            profiler = cProfile.Profile()
            profiler.runcall(measure, scheduler, args.steps, 0)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
            continue
        schedule_us: list[float] = []
        update_us: list[float] = []
        for repeat in range(args.repeats):
            scheduler = build(kind, args.num_seqs, args.block_size, repeat, args.policy, args.waiting)
            s_us, u_us = measure(scheduler, args.steps, seed=repeat)
            schedule_us += s_us
            update_us += u_us
            assert scheduler.num_running == args.num_seqs and scheduler.recorder.steps[-1][
                "num_decode_seqs"] == args.num_seqs, "the benchmark must measure full decode steps"
        costs = [a + b for a, b in zip(schedule_us, update_us)]
        median = statistics.median(costs)
        p99 = statistics.quantiles(costs, n=100)[98]
        print(f"{kind:<10} {median:>10.1f} {p99:>8.1f} {statistics.fmean(costs):>8.1f} "
              f"{median / args.num_seqs:>7.3f} {statistics.median(schedule_us):>12.1f} "
              f"{statistics.median(update_us):>10.1f}")
    if not args.profile:  # the machine may be shared: CPU time still grows with contention
        print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
