"""The two processes of `experiments.bench_kv_receive`, each side's measurements: the decode side
(`receive_side`: its runner and KV cache, the scatter timings, the receives the sender times, the
decode steps idle, beside waves of receives and through the duty-cycle sweep, then the receives of
the send-side sweep) and the prefill side (`send_side`: its runner and KV cache, built by the
entry point; the send's host time per message size, the sends the receiver asks for, then prefill
steps beside its own sends, experiments/lib/kv_send_duty.py). The bench's entry point parses the
options, starts the two and writes the profile from what they return; the phases are described in
its docstring. Every wait for the other process is bounded by the link's timeout or the budget,
each side's build by STARTUP_S (the other side's wait for it).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kernels
from engine.config import CacheConfig
from engine.device.model_runner import ModelRunner
from engine.disagg.kv_transfer import RECV_RANK, KVLink, join_store
from engine.disagg.kv_transfer_message import interleaved
from engine.model_loader import load_model_config
from experiments.lib.kv_link_bench import LINK_TIMEOUT_S, spread_blocks, sync_compute, sync_device
from experiments.lib.kv_receive_duty import duty_sweep
from experiments.lib.kv_send_duty import END, POST, send_sweep, serve_receives
from experiments.lib.profiling.synthetic import StepShape, blocks_needed, synthetic_step

STARTUP_S = 300.0  # the receiver's runner build (torch.compile, CUDA graphs) and scatter timings, at most


def _pinned_ids(ids: list[int], dev: torch.device) -> torch.Tensor:
    """Block ids on the device as `KVLink` puts them there (pinned memory, no host sync)."""
    index = torch.tensor(ids, dtype=torch.int64)
    return index if dev.type != "cuda" else index.pin_memory().to(dev, non_blocking=True)


def _scatter_s(k, v, n: int, iters: int, dev: torch.device) -> float:
    """Median device time of scattering a received message of `n` blocks (wall time on the CPU)."""
    staging = torch.randn((2 * len(k), n, *k[0].shape[1:]), device=dev).to(k[0].dtype)
    caches, times = interleaved(k, v), []
    for i in range(iters + 2):
        ids = spread_blocks(n, k[0].shape[0], 7 + i)
        sync_device(dev)
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            kernels.scatter_blocks(staging, caches, _pinned_ids(ids, dev))
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            kernels.scatter_blocks(staging, caches, _pinned_ids(ids, dev))
            seconds = time.perf_counter() - t0
        if i >= 2:
            times.append(seconds)
    return statistics.median(times)


def build_runner(a: argparse.Namespace, dev: torch.device, shape: StepShape, max_num_batched_tokens: int,
                 max_num_seqs: int) -> ModelRunner:
    """The engine's runner of `a.model` on `dev` (dummy weights; CUDA graphs on a GPU) whose cache
    holds a step of `shape` and twice the largest message of the bench."""
    sizes = [int(b) for b in a.blocks.split(",")]
    return step_runner(a.model, dev, shape, a.block_size, max(sizes + [a.busy_blocks, a.duty_blocks]),
                       max_num_batched_tokens, max_num_seqs, a.decode_kernel)


def step_runner(model: str, dev: torch.device, shape: StepShape, block_size: int, largest_message: int,
                max_num_batched_tokens: int, max_num_seqs: int, decode_kernel: str = "auto") -> ModelRunner:
    """The engine's runner of `model` on `dev` (dummy weights; CUDA graphs on a GPU) whose cache
    holds a step of `shape` and two messages of `largest_message` blocks."""
    cfg = load_model_config(model)
    max_model_len = min(4096, cfg.max_position_embeddings)
    num_blocks = max(blocks_needed(shape, block_size) + 2 * largest_message, -(-max_model_len // block_size))
    return ModelRunner(cfg, CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks, swap_space=0.01),
                       max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, device=dev, decode_kernel=decode_kernel)


def prefill_shape(a: argparse.Namespace) -> StepShape:
    """The send-side sweep's step: `--prefill-tokens` in `--prefill-seqs` prompts, no decode."""
    return StepShape(a.prefill_tokens, a.prefill_seqs, 0, 0)


class Steps:
    """One synthetic step per call, run as the engine runs its steps. Scheduled ahead (the default,
    as the pair's engines run with async scheduling): a call launches a step, then waits for the
    one launched before it, so one step is always in flight and the host's work for a step overlaps
    the device's work on the one before; a call's wall time is the period between steps, what the
    engine's step rows measure. `sync` (`--sync-steps`): each call launches its step and waits for
    it (the compute stream only), the host's work in series with the device's."""

    def __init__(self, runner: ModelRunner, step, dev: torch.device, sync: bool) -> None:
        self.runner, self.step, self.dev, self.sync = runner, step, dev, sync
        self.in_flight = None

    def launch(self) -> None:
        """Synchronised, in two halves: launch the step (then the host may work beside it)..."""
        self.in_flight = self.runner.launch(self.step)

    def finish(self) -> None:
        """...and wait for it (its tokens, then the compute stream)."""
        self.runner.collect(self.in_flight)
        self.in_flight = None
        sync_compute(self.dev)

    def __call__(self) -> None:
        if self.sync:
            self.launch()
            self.finish()
            return
        launched = self.runner.launch(self.step)
        if self.in_flight is not None:
            self.runner.collect(self.in_flight)
        self.in_flight = launched

    def drain(self) -> None:
        """Wait for the step in flight (between phases: the next phase's first call starts clean)."""
        if self.in_flight is not None:
            self.runner.collect(self.in_flight)
            self.in_flight = None


def receive_side(port: int, conn, a: argparse.Namespace) -> None:
    """The decode side: its runner and cache; scatter times, receives for the sender's timings, then
    decode steps idle and beside receives. Answers on `conn`; every wait bounded by the link."""
    dev = torch.device("cuda", 1) if a.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)  # as the sender's (experiments/bench_kv_receive.py)
    # The link first: the sender's end waits for it within the link's timeout, not for the build.
    link = KVLink(RECV_RANK, join_store(port, LINK_TIMEOUT_S), dev, LINK_TIMEOUT_S)
    cfg = load_model_config(a.model)
    shape = StepShape(0, 0, a.decode_seqs, a.context)
    sizes = [int(b) for b in a.blocks.split(",")]
    runner = build_runner(a, dev, shape, max(2048, a.decode_seqs), max(256, a.decode_seqs))
    k, v = runner.kv_cache.k_caches, runner.kv_cache.v_caches
    started = time.monotonic()
    out = {"scatter_s": {n: _scatter_s(k, v, n, a.iters, dev) for n in sizes}}
    conn.send(("scatter", out["scatter_s"]))
    if not conn.poll(STARTUP_S):  # the sender builds its runner meanwhile
        raise RuntimeError(f"the sender's runner was not built within {STARTUP_S} s")
    while (msg := conn.recv()) is not None:  # the sender's send timings: post, say ready, wait
        transfer = link.recv([("r", list(range(msg)))], k)
        conn.send("ready")
        done = link.wait_all(LINK_TIMEOUT_S)
        conn.send("done" if done and done[0] is transfer and transfer.error is None else "failed")
    step = synthetic_step(shape, a.block_size, runner.num_gpu_blocks, cfg.vocab_size)
    steps = Steps(runner, step, dev, a.sync_steps)
    for _ in range(10):
        steps()
    steps.drain()
    idle, busy = [], []
    for _ in range(a.rounds):
        if time.monotonic() - started > a.budget_s:
            break
        for _ in range(a.steps):
            t0 = time.perf_counter()
            link.poll()  # the decode loop polls its link every turn
            steps()
            idle.append(time.perf_counter() - t0)
        steps.drain()
        got = 0  # then as many steps beside receives
        while got < a.steps and time.monotonic() - started <= a.budget_s:
            wave = [link.recv([("w", list(range(a.busy_blocks)))], k) for _ in range(a.wave)]
            conn.send(("wave", a.wave))
            ended = []
            while link.num_in_flight and got < a.steps:
                before = link.num_in_flight
                t0 = time.perf_counter()
                ended += link.poll()
                steps()
                seconds = time.perf_counter() - t0
                if before and link.num_in_flight:  # a receive on the wire from its start to its end
                    busy.append(seconds)
                    got += 1
            steps.drain()
            done = ended + link.wait_all(LINK_TIMEOUT_S)
            if len(done) != len(wave) or any(t.error is not None for t in done):
                raise RuntimeError(f"a wave of {len(wave)} receives did not complete within {LINK_TIMEOUT_S} s")
    sweep = duty_sweep(link, steps, lambda: conn.send(("one", 1)),
                       lambda: link.recv([("d", list(range(a.duty_blocks)))], k),
                       [(u, lead / 1e3) for lead in a.post_leads for u in a.duty_utilisations], a.duty_steps,
                       started + a.budget_s, LINK_TIMEOUT_S)
    steps.drain()
    conn.send(("steps", idle, busy, sweep))
    # The send-side sweep: a receive posted each time the sender asks, right before its send.
    got = serve_receives(link, conn, lambda: link.recv([("s", list(range(a.duty_blocks)))], k),
                         max(LINK_TIMEOUT_S, a.budget_s))
    conn.send(("received", *got))
    link.close()


def send_side(link: KVLink, conn, runner: ModelRunner, a: argparse.Namespace) -> dict:
    """The prefill side (`runner`: its engine's runner and KV cache): the send's host time per size,
    waves of sends when the receiver asks, then prefill steps beside its own sends."""
    k, v, dev = runner.kv_cache.k_caches, runner.kv_cache.v_caches, link.device
    cfg = runner.model_config
    step = synthetic_step(prefill_shape(a), a.block_size, runner.num_gpu_blocks, cfg.vocab_size)
    warm = Steps(runner, step, dev, sync=True)
    for _ in range(5):  # warm-up, while the receiver builds its runner
        warm()
    if not conn.poll(STARTUP_S + a.budget_s):
        raise SystemExit("error: the receiver did not time its scatters")
    _, scatter = conn.recv()
    started = time.monotonic()  # the budget counts from the receiver's runner being built
    sizes, send, sent_at = sorted(scatter), {}, []
    for n in sizes:
        times = []
        for i in range(a.iters + 2):
            if time.monotonic() - started > a.budget_s:
                break
            conn.send(n)
            if not conn.poll(LINK_TIMEOUT_S) or conn.recv() != "ready":
                raise SystemExit("error: the receiver did not post its receive")
            ids = spread_blocks(n, k[0].shape[0], i)
            sync_device(link.device)
            t0 = time.perf_counter()
            link.send([("r", ids)], k, v)
            times.append(time.perf_counter() - t0)
            link.wait_all(LINK_TIMEOUT_S)
            if not conn.poll(LINK_TIMEOUT_S) or conn.recv() != "done":
                raise SystemExit("error: a transfer did not complete")
        if len(times) > 2:
            send[n] = statistics.median(times[2:])
    conn.send(None)
    while True:
        if not conn.poll(max(LINK_TIMEOUT_S, a.budget_s)):
            raise SystemExit("error: the receiver did not finish its decode steps")
        msg = conn.recv()
        if msg[0] == "steps":
            sends = _send_sweep(link, conn, runner, step, a, started + a.budget_s)
            return {"scatter": scatter, "send": send, "idle": msg[1], "busy": msg[2], "sweep": msg[3],
                    "sent_at": sent_at, "send_sweep": sends}
        if msg[0] == "one":  # one message of the duty sweep, not waited for
            link.poll()  # the sends that ended let go of their staging buffers
            link.send([("d", spread_blocks(a.duty_blocks, k[0].shape[0], len(sent_at)))], k, v)
            sent_at.append(time.monotonic())
            continue
        for i in range(msg[1]):
            link.send([("w", spread_blocks(a.busy_blocks, k[0].shape[0], 100 + i))], k, v)
        link.wait_all(LINK_TIMEOUT_S)


def _send_sweep(link: KVLink, conn, runner: ModelRunner, step, a: argparse.Namespace, deadline: float) -> dict:
    """Prefill steps idle and beside sends of `--duty-blocks` blocks (kv_send_duty.send_sweep), each
    send's receive posted by the receiver right before it; then the receiver's count of them."""
    k, v, dev, count = runner.kv_cache.k_caches, runner.kv_cache.v_caches, link.device, [0]

    def send_one() -> None:
        conn.send(POST)
        if not conn.poll(LINK_TIMEOUT_S) or conn.recv() != "posted":
            raise RuntimeError(f"the receiver did not post a receive within {LINK_TIMEOUT_S} s")
        # As the pair's front posts a send during a step: the gather does not wait for the compute
        # stream (these blocks are not written by the steps).
        link.send([("s", spread_blocks(a.duty_blocks, k[0].shape[0], 1000 + count[0]))], k, v, after_compute=False)
        count[0] += 1

    # Synchronised: the pair's front runs its prefill steps so (disaggregation.prefill_async_scheduling
    # is off by default), its host work between steps in series with the device's.
    steps = Steps(runner, step, dev, sync=True)
    try:
        sweep = send_sweep(link, steps, send_one, a.duty_utilisations, a.send_steps,
                           a.send_steps, deadline, LINK_TIMEOUT_S, after_launch=a.send_posted == "after-launch")
        steps.drain()
    finally:
        conn.send(END)
    if not conn.poll(LINK_TIMEOUT_S):
        raise SystemExit("error: the receiver did not complete the send sweep's receives")
    _, posted, completed = conn.recv()
    if posted != count[0] or completed != count[0]:
        raise SystemExit(f"error: the send sweep sent {count[0]} messages; the receiver posted {posted} "
                         f"receives and completed {completed}")
    return sweep
