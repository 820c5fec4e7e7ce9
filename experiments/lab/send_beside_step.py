"""What a KV message's gather loses when it runs beside a prefill step on the same GPU: the receive
profile's `send_beside_step` (sim/latency/kv_receive.py), by which the simulator delays a message
whose turn on the link comes during its prefill replica's step.

`python -m experiments.lab.send_beside_step --model M [--blocks 20,40,80,160]
[--prefill-tokens 4000] [--prefill-seqs 6] [--delays 0.1,0.3,0.5,0.7] [--iters 10] [--profile F]`

The pair's front posts a send while it waits for its running prefill step (sends mid-step, the
default): the gather into the staging buffer (`kernels.gather_blocks`, one launch on the link's
side stream, as `KVLink.send` runs it) then shares the SMs with the forward on the compute stream,
and its thread blocks wait for room. On one GPU, the prefill engine's `ModelRunner` (dummy weights,
CUDA graphs, a synthetic step of `--prefill-tokens` in `--prefill-seqs` prompts) and, for each
message size of `--blocks`, the gather timed by CUDA events on a side stream: alone (`--iters`
times), then launched that far into a running step for each fraction of the idle step in `--delays`
(`--iters` each). A size's figure is the median beside less the median alone: the seconds the step
costs the message. Printed; with `--profile F` the figures (bytes:seconds) and a
`send_beside_from` provenance line go into the receive profile F, its other lines kept (a
profile is refused before the run if the simulator could not read it, or if its `# model:` line
names another model).

Measured here: the gather only. NCCL's send kernel, beside the same forward, loses its share too;
that needs two GPUs and is not in the figure.
"""
from __future__ import annotations

import argparse
import datetime as dt
import math
import statistics
import time
from pathlib import Path

from sim.latency.kv_receive import SEND_BESIDE_KEY, read_receive_profile

FROM_KEY = "send_beside_from"


def parse_list(text: str, kind, name: str, low: float, high: float) -> list:
    """Comma-separated values of `kind` in [low, high], sorted and distinct; a ValueError naming
    `name`."""
    try:
        values = sorted({kind(x) for x in text.split(",")})
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) for v in values) or values[0] < low or values[-1] > high:
        raise ValueError(f"{name}={text!r} is invalid: comma-separated {kind.__name__}s "
                         f"in [{low:g}, {high:g}]")
    return values


def beside_seconds(alone: dict[int, list[float]], beside: dict[int, list[float]]) -> dict[int, float]:
    """Per size: the median gather beside a step over the median alone (seconds, >= 0)."""
    return {n: max(0.0, statistics.median(beside[n]) - statistics.median(alone[n])) for n in alone}


def write_into_profile(path: str | Path, points: list[tuple[float, float]], source: str) -> None:
    """The receive profile at `path` with its `send_beside_step` and `send_beside_from` lines
    replaced by `points` (bytes, seconds) and `source`; checked readable before it is kept."""
    path = Path(path)
    keep = [line for line in path.read_text().splitlines()
            if not line.startswith((f"# {SEND_BESIDE_KEY}:", f"# {FROM_KEY}:"))]
    pairs = " ".join(f"{b:.0f}:{s:.4e}" for b, s in points)
    text = "\n".join([*keep, f"# {SEND_BESIDE_KEY}: {pairs}", f"# {FROM_KEY}: {source}"]) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    try:
        read_receive_profile(tmp)
    except ValueError:
        tmp.unlink()
        raise
    tmp.replace(path)


def measure(model: str, blocks: list[int], prefill_tokens: int, prefill_seqs: int, delays: list[float],
            iters: int, block_size: int = 16) -> tuple[dict, dict, dict, float, str]:
    """On cuda:0: (bytes per size, gathers alone per size, gathers beside per size, the idle step's
    seconds, the device's name); each gather in seconds."""
    import torch

    import kernels
    from engine.disagg.kv_transfer_message import interleaved, staging_shape
    from experiments.lib.kv_link_bench import spread_blocks
    from experiments.lib.kv_receive_sides import Steps, step_runner
    from experiments.lib.profiling.synthetic import StepShape, synthetic_step

    if not torch.cuda.is_available():
        raise SystemExit("error: experiments.lab.send_beside_step runs on a GPU (a step and a gather on two "
                         "streams of one device)")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    shape = StepShape(prefill_tokens, prefill_seqs, 0, 0)
    runner = step_runner(model, dev, shape, block_size, max(blocks), max(8192, prefill_tokens), 256)
    k, v = runner.kv_cache.k_caches, runner.kv_cache.v_caches
    steps = Steps(runner, synthetic_step(shape, block_size, runner.num_gpu_blocks, runner.model_config.vocab_size),
                  dev, sync=True)
    for _ in range(5):
        steps()
    idle = []
    for _ in range(10):
        t0 = time.perf_counter()
        steps()
        idle.append(time.perf_counter() - t0)
    step_s = statistics.median(idle)
    side = torch.cuda.Stream(dev)

    def gather(ids: torch.Tensor, staging: torch.Tensor, delay: float | None) -> float:
        """One gather on the side stream (`delay` seconds into a step launched first, or alone)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        if delay is not None:
            steps.launch()
            time.sleep(delay)
        with torch.cuda.stream(side):
            start.record()
            kernels.gather_blocks(interleaved(k, v), ids, staging)
            end.record()
        if delay is not None:
            steps.finish()
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end) / 1e3

    sizes, alone, beside = {}, {}, {}
    for n in blocks:
        ids = torch.tensor(spread_blocks(n, k[0].shape[0], n), dtype=torch.int64, device=dev)
        staging = torch.empty(staging_shape(k, n), dtype=k[0].dtype, device=dev)
        sizes[n] = staging.numel() * staging.element_size()
        for _ in range(2):  # warm-up
            gather(ids, staging, None)
        alone[n] = [gather(ids, staging, None) for _ in range(iters)]
        beside[n] = [gather(ids, staging, f * step_s) for f in delays for _ in range(iters)]
    return sizes, alone, beside, step_s, torch.cuda.get_device_name(dev)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--blocks", default="20,40,80,160", help="message sizes in blocks, comma-separated")
    ap.add_argument("--prefill-tokens", type=int, default=4000)
    ap.add_argument("--prefill-seqs", type=int, default=6)
    ap.add_argument("--delays", default="0.1,0.3,0.5,0.7", help="fractions of the idle step, comma-separated")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", default=None, help="a receive profile to write the figures into")
    args = ap.parse_args(argv)
    try:
        blocks = parse_list(args.blocks, int, "--blocks", 1, 100_000)
        delays = parse_list(args.delays, float, "--delays", 0.0, 0.95)
    except ValueError as e:
        ap.error(str(e))
    if args.iters < 1 or not 1 <= args.prefill_seqs <= args.prefill_tokens <= 8192 \
            or -(-args.prefill_tokens // args.prefill_seqs) > 4096:
        ap.error(f"--iters={args.iters}, --prefill-tokens={args.prefill_tokens}, "
                 f"--prefill-seqs={args.prefill_seqs} "
                 "are invalid: iters >= 1, 1 <= seqs <= tokens <= 8192, at most 4096 tokens a prompt")
    if args.profile:
        try:
            profile = read_receive_profile(args.profile)  # refused before the run
        except ValueError as e:
            ap.error(f"--profile={args.profile!r}: {e}")
        if profile.model is not None and profile.model != args.model:
            ap.error(f"--profile={args.profile!r} is {profile.model}'s receive profile, "
                     f"not --model={args.model}'s")
    sizes, alone, beside, step_s, device = measure(args.model, blocks, args.prefill_tokens, args.prefill_seqs,
                                                   delays, args.iters)
    extra = beside_seconds(alone, beside)
    print(f"{args.model} on {device}: prefill step of {args.prefill_tokens} tokens in {args.prefill_seqs} "
          "prompts, "
          f"idle {step_s * 1e3:.2f} ms; the gather launched at {args.delays} of it")
    print(f"{'blocks':>7} {'MB':>8} {'alone ms':>9} {'beside ms':>10} {'p90 beside':>11} {'lost ms':>8}")
    for n in blocks:
        b = sorted(beside[n])
        print(f"{n:>7} {sizes[n] / 1e6:>8.1f} {statistics.median(alone[n]) * 1e3:>9.3f} "
              f"{statistics.median(b) * 1e3:>10.3f} {b[int(0.9 * (len(b) - 1))] * 1e3:>11.3f} "
              f"{extra[n] * 1e3:>8.3f}")
    if args.profile:
        when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        source = (f"python -m experiments.lab.send_beside_step --model {args.model} --blocks {args.blocks} "
                  f"--prefill-tokens {args.prefill_tokens} --prefill-seqs {args.prefill_seqs} "
                  f"--delays {args.delays} "
                  f"--iters {args.iters} ({device}, {when}; idle step {step_s * 1e3:.2f} ms)")
        write_into_profile(args.profile, [(sizes[n], extra[n]) for n in blocks], source)
        print(f"-> {args.profile}")


if __name__ == "__main__":
    main()
