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

import numpy as np
import torch

from engine.disagg.config import DisaggregationConfig
from engine.disagg.pd_engine import DisaggregatedEngine
from engine.engine_args import EngineArgs
from experiments.lib.front_timers import NOT_HOST, PARTS, READS, PartTimer, instrument
from policies.request import SamplingParams

ROUND_BOUND_S = 300.0  # one round's requests all end within this


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
