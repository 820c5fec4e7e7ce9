"""`python -m experiments.bench_handoff_host`: the disaggregated pair's front (engine/disagg/pd_engine.py),
its host time per hand-off, by part.

One `DisaggregatedEngine` (the tiny model on the CPU over gloo by default; `--model`/`--device` for a
GPU pair) takes `--requests` short prompts at once (`--prompt-len` tokens each), so each prefill
step of `--max-batched-tokens` prefills and hands off many requests. Two kinds of round alternate,
`--rounds` of each, on the same pair:
- `handoff`: max_tokens=1 + `--decode-tokens` (default 1), so every request is handed off after its
  first token (the front's hand-off path: the request ending at its first token, its `KVHandoff`, its
  message, the transfer's bookkeeping) and decodes that many tokens on the decode engine, whose
  outputs the front reads back (more decode tokens: the front's reads per token, which grow with
  the answers' length, not with the hand-offs);
  With `--output-kind delta` (or `cumulative`) the handed-off requests stream, as the OpenAI
  server's do: the decode engine sends an output of every running request every step;
- `local`: max_tokens=1, so every request ends at its first token on the prefill side, as on a
  co-located engine (no hand-off): the same prefill steps without the hand-off path.

The front's methods on that path are wrapped with a timer (exclusive time per part, nested calls
subtracted), and its idle waits for the decode process (`poll` with a timeout) are counted apart.
Host time = the front's `step()` wall time minus the prefill engine's forward
(`ModelRunner.execute`, input preparation and sampling included) minus those waits. Printed, per
request: the host time of each kind of round and their difference (what a hand-off adds), then the
parts of both kinds of round. Medians over the rounds. Each figure comes on two clocks: the wall
clock (what the front's loop takes) and the front thread's CPU time (`time.thread_time`: not counting
time the thread waits for a core or for the GIL, so steadier on a shared host). The timers add
~1-2 us per wrapped call. The decode process shares the host's cores (on the CPU each engine
process gets `--threads` torch threads, default 1), so on a small machine its work slows the
front's wall time too (the load average is printed).

GPU (2 GPUs: prefill on cuda:0, decode on cuda:1):
`timeout 600 python -m experiments.bench_handoff_host --model qwen3-0.6b --device cuda --requests 1024
--prompt-len 16 --max-batched-tokens 2048 --rounds 5`; with `--decode-tokens 64` the front's reads of
the decode engine's outputs, per request (64 tokens each, about the fidelity spec's mean answer);
with `--output-kind delta` those of streams (an output per token). The handoff rounds' host time is
also printed per decoded token (`--decode-tokens` of them per request), in all and for the reads of
the decode process's messages alone (`recv + unpickle`, `take messages (rest)`, `decode outputs`).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from engine.disagg.config import DisaggregationConfig
from engine.disagg.pd_engine import DisaggregatedEngine
from engine.engine_args import EngineArgs
from policies.request import SamplingParams

ROUND_BOUND_S = 300.0  # one round's requests all end within this


class PartTimer:
    """Exclusive time per part, on the wall clock and on the front thread's CPU clock: a wrapped
    call's time less that of the wrapped calls inside it."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # [wall, cpu] spent in wrapped calls inside it

    def wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            inner = [0.0, 0.0]
            self._stack.append(inner)
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
                self._stack.pop()
                self.wall[part] += wall - inner[0]
                self.cpu[part] += cpu - inner[1]
                self.calls[part] += 1
                if self._stack:
                    self._stack[-1][0] += wall
                    self._stack[-1][1] += cpu

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()


class _Reads:
    """The front's reads of the pipe (its `PipeReceiver`; an older front's `Connection`), its waits
    with a timeout timed apart (the idle front's wait)."""

    def __init__(self, receiver, timer: PartTimer) -> None:
        self._receiver = receiver
        timer.wrap(self, "_wait", "idle wait")
        timer.wrap(self, "_arriving", "arriving wait")

    def _wait(self, timeout: float) -> bool:
        return self._receiver.poll(timeout)

    def _arriving(self, arriving_s: float) -> bool:
        return self._receiver.poll(0, arriving_s)

    def poll(self, timeout: float = 0.0, arriving_s: float = 0.0) -> bool:
        """The front's reads: a wait with a timeout (idle) and the wait for a message on its way in
        (`PipeReceiver.poll`'s `arriving_s`) are timed apart; an older receiver takes no `arriving_s`."""
        if timeout:
            return self._wait(timeout)
        if self._receiver.poll(0):
            return True
        return self._arriving(arriving_s) if arriving_s else False

    def recv(self):
        return self._receiver.recv()

    def __getattr__(self, name: str):
        return getattr(self._receiver, name)


# (owner attribute path on the front, method, part); the order is the table's.
PARTS = (
    ("", "step", "front loop (rest)"),
    ("prefill.scheduler", "schedule", "schedule"),
    ("prefill.runner", "execute", "forward"),
    ("prefill.scheduler", "update", "scheduler update (rest)"),
    ("side", "hand_off", "PrefillSide.hand_off"),
    ("prefill", "step", "prefill step outputs"),
    ("", "_hand_off_all", "front hand-off batch (rest)"),
    ("", "_hand_off", "front _hand_off (rest)"),
    ("prefill", "hand_over_request", "hand_over_request"),
    ("_sender", "send", "pickle + queue message"),
    ("_receiver", "recv", "recv + unpickle"),  # the read itself is the pipe's reader thread's
    ("", "_take_messages", "take messages (rest)"),
    ("", "_start_transfer", "start transfer (rest)"),
    ("link", "send", "KVLink.send"),
    ("", "_finish_transfers", "finish transfers (rest)"),
    ("side", "finish_transfer", "PrefillSide.finish_transfer"),
    ("", "_decode_outputs", "decode outputs"),
    ("", "_check_decode_alive", "check decode alive"),
)
NOT_HOST = ("forward", "idle wait", "arriving wait")
READS = ("recv + unpickle", "take messages (rest)", "decode outputs")  # the decode process's messages read back


def _owner(engine, path: str):
    owner = engine
    for name in filter(None, path.split(".")):
        owner = getattr(owner, name)
    return owner


def instrument(engine: DisaggregatedEngine) -> PartTimer:
    timer = PartTimer()
    reads = "_receiver" if hasattr(engine, "_receiver") else "_conn"  # an older front read the pipe itself
    engine._receiver = _Reads(getattr(engine, reads), timer)
    setattr(engine, reads, engine._receiver)
    for path, name, part in PARTS:
        owner = _owner(engine, path)
        if hasattr(owner, name):  # a front without that method (an older tree, for an A/B) skips it
            timer.wrap(owner, name, part)
    return timer


def run_round(engine: DisaggregatedEngine, timer: PartTimer, prompts: list[list[int]], max_tokens: int,
              tag: str, output_kind: str = "final_only") -> dict[str, dict[str, float]]:
    """Seconds per part over one round, by clock ("wall", "cpu"): every request added at once,
    stepped until all end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=output_kind)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    timer.reset()
    deadline, ended = time.monotonic() + ROUND_BOUND_S, 0
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {tag}: {len(prompts) - ended} requests did not end within {ROUND_BOUND_S:g} s")
        for out in engine.step():
            if out.finished:
                if out.error is not None:
                    raise RuntimeError(f"round {tag}: request {out.request_id} failed: {out.error}")
                ended += 1
    return {"wall": dict(timer.wall), "cpu": dict(timer.cpu)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--device", default="cpu", help="the prefill engine's (cuda: the decode engine's is cuda:1)")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--max-batched-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind (handoff, local), alternating")
    ap.add_argument("--decode-tokens", type=int, default=1,
                    help="tokens each handed-off request decodes on the decode engine (max_tokens = 1 + this)")
    ap.add_argument("--output-kind", default="final_only", choices=["final_only", "delta", "cumulative"],
                    help="the handed-off requests' (delta, cumulative: streams, an output per decoded token)")
    ap.add_argument("--num-gpu-blocks", type=int, default=None, help="default: every request's blocks fit")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's CPU threads per engine process (CPU runs; more oversubscribe a small host)")
    args = ap.parse_args(argv)
    for name in ("requests", "prompt_len", "max_batched_tokens", "rounds", "decode_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    block_size = 16
    handoff_tokens = 1 + args.decode_tokens
    blocks = args.num_gpu_blocks or args.requests * -(-(args.prompt_len + handoff_tokens) // block_size) + 64
    engine_args = EngineArgs(model=args.model, device=args.device, num_gpu_blocks=blocks, swap_space=0.01,
                             max_model_len=max(64, args.prompt_len + handoff_tokens + 8), block_size=block_size,
                             max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.requests)
    config = DisaggregationConfig(max_queue=args.requests, transfer_timeout_s=60.0,
                                  decode_args={"num_gpu_blocks": blocks, "max_num_seqs": args.requests})
    if args.device == "cpu":  # the decode process reads the variable as it starts
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    with DisaggregatedEngine(engine_args, config, keep_trace=False) as engine:
        vocab = min(engine.vocab_size, 30000)
        prompts = [rng.integers(10, vocab, args.prompt_len).tolist() for _ in range(args.requests)]
        timer = instrument(engine)
        run_round(engine, timer, prompts, handoff_tokens, "warm-h", args.output_kind)
        run_round(engine, timer, prompts, 1, "warm-l")
        rounds: dict[str, list[dict[str, float]]] = {"handoff": [], "local": []}
        for r in range(args.rounds):
            rounds["handoff"].append(run_round(engine, timer, prompts, handoff_tokens, f"h{r}", args.output_kind))
            rounds["local"].append(run_round(engine, timer, prompts, 1, f"l{r}"))
    n = args.requests
    print(f"# {platform.node()} {platform.machine()} ({platform.processor() or 'cpu'}), {os.cpu_count()} cores, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, Python {platform.python_version()}")
    print(f"# model={args.model} device={args.device} requests={n} prompt_len={args.prompt_len} "
          f"max_batched_tokens={args.max_batched_tokens} (~{args.max_batched_tokens // args.prompt_len} hand-offs "
          f"per prefill step) decode_tokens={args.decode_tokens} output_kind={args.output_kind} rounds={args.rounds}")

    def host_us(kind: str, clock: str) -> list[float]:
        return [sum(v for k, v in r[clock].items() if k not in NOT_HOST) / n * 1e6 for r in rounds[kind]]

    def med(values: list[float]) -> str:
        return f"{statistics.median(values):8.1f}"

    print("\nfront host time per request, us (median over rounds; each round's in brackets): wall clock, then "
          "the front thread's CPU time")
    for clock in ("wall", "cpu"):
        hand, local = host_us("handoff", clock), host_us("local", clock)
        print(f"{f'handoff (max_tokens={handoff_tokens})':26s} {clock:4s} {med(hand)}  [{', '.join(f'{x:.1f}' for x in hand)}]")
        print(f"{'local (max_tokens=1)':26s} {clock:4s} {med(local)}  [{', '.join(f'{x:.1f}' for x in local)}]")
        print(f"{'added per hand-off':26s} {clock:4s} {med([h - v for h, v in zip(hand, local)])}")
        per_token = [h / args.decode_tokens for h in hand]
        print(f"{'handoff per decoded token':26s} {clock:4s} {med(per_token)}  [{', '.join(f'{x:.2f}' for x in per_token)}]")
        reads = [sum(r[clock].get(part, 0.0) for part in READS) / n / args.decode_tokens * 1e6 for r in rounds["handoff"]]
        print(f"{'reads per decoded token':26s} {clock:4s} {med(reads)}  [{', '.join(f'{x:.2f}' for x in reads)}]")
    print("\nparts, us per request (median over rounds)")
    print(f"{'part':32s} {'handoff':>8s} {'(cpu)':>8s} {'local':>8s} {'(cpu)':>8s}")
    for part in [p for _, _, p in PARTS] + ["idle wait", "arriving wait"]:
        cells = [med([r[clock].get(part, 0.0) / n * 1e6 for r in rounds[kind]])
                 for kind in ("handoff", "local") for clock in ("wall", "cpu")]
        print(f"{part:32s} {' '.join(cells)}{'   (not host)' if part in NOT_HOST else ''}")


if __name__ == "__main__":
    main()
