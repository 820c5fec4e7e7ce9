"""How long a synchronous prefill engine's step keeps its host before it waits for the device: the
front host profile's launch units (sim/fleet/front_host.py), during which the disaggregated pair's
front takes no answer from the decode side (its pipe's reader thread waits for the interpreter
lock; the front polls the pipe only while it waits for the step).

`python -m experiments.lab.prefill_launch --model M [--prompts 2,4,8] [--steps 30] [--profile F]`

An engine as the pair's prefill engine runs (no async scheduling, `--max-batched-tokens` 8192) takes
`--steps` rounds of N prompts of 256-1024 random tokens (one output token each, final output only)
for each N of `--prompts`; `ModelRunner.launch` (input preparation and the launches, sampling's
included) is timed per step and its median per N fitted as `launch_s + launch_prompt_s x N` (least
squares). Printed; with `--profile F` the two units (and a `launch_from` provenance line) are
written into the front host profile F, its other units kept. One GPU; the host's speed moves it (measure it
on the pair's own machine).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import statistics
import time

import numpy as np

from sim.fleet.front_host import FrontHostProfile


def launch_medians(model: str, prompts: list[int], steps: int, max_batched_tokens: int,
                   device: str | None = None, seed: int = 0) -> dict[int, float]:
    """Median seconds of `ModelRunner.launch` per step, for steps of N prompts, N in `prompts`."""
    from engine.engine_args import EngineArgs
    from engine.offline.llm_engine import LLMEngine
    from policies import SamplingParams

    engine = LLMEngine(EngineArgs(model=model, device=device, async_scheduling=False, max_model_len=2048,
                                  max_num_batched_tokens=max_batched_tokens))
    runner, times = engine.runner, []
    launch = runner.launch

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return launch(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t0)

    runner.launch = timed
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=1, ignore_eos=True, output_kind="final_only")
    vocab = min(30000, engine.vocab_size)
    medians = {}
    try:
        for n in prompts:
            times.clear()
            for r in range(steps + 3):  # three warm-up steps
                for i in range(n):
                    engine.add_request(f"{n}-{r}-{i}", rng.integers(10, vocab, int(rng.integers(256, 1024))).tolist(),
                                       params)
                while engine.has_unfinished_requests():
                    engine.step()
            medians[n] = statistics.median(times[3:])
    finally:
        engine.close()
    return medians


def fit(medians: dict[int, float]) -> tuple[float, float]:
    """(launch_s, launch_prompt_s): the least-squares line through the medians, both >= 0."""
    n = np.array(list(medians), dtype=float)
    slope, intercept = np.polyfit(n, np.array(list(medians.values())), 1) if len(n) > 1 else (0.0, medians[int(n[0])])
    return max(0.0, float(intercept)), max(0.0, float(slope))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="2,4,8", help="prompts per step, comma-separated")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--device", default=None)
    ap.add_argument("--profile", default=None, help="a front host profile to write the launch units into")
    args = ap.parse_args(argv)
    try:
        prompts = sorted({int(p) for p in args.prompts.split(",")})
    except ValueError:
        ap.error(f"--prompts={args.prompts!r} is invalid: comma-separated integers >= 1")
    if not prompts or prompts[0] < 1 or args.steps < 1:
        ap.error(f"--prompts={args.prompts!r} and --steps={args.steps} are invalid: integers >= 1")
    profile = FrontHostProfile.read(args.profile) if args.profile else None  # refused before the run
    medians = launch_medians(args.model, prompts, args.steps, args.max_batched_tokens, args.device)
    for n, t in medians.items():
        print(f"{args.model}, {n} prompts a step: launch median {t * 1e3:.3f} ms")
    base, per_prompt = fit(medians)
    print(f"launch_s {base * 1e6:.1f} us, launch_prompt_s {per_prompt * 1e6:.1f} us")
    if profile is not None:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        source = (f"python -m experiments.lab.prefill_launch --model {args.model} --prompts {args.prompts} "
                  f"--steps {args.steps} ({device}, {when}; medians "
                  + ", ".join(f"{n}: {t * 1e3:.2f} ms" for n, t in medians.items()) + ")")
        meta = tuple((k, v) for k, v in profile.meta if k != "launch_from") + (("launch_from", source),)
        dataclasses.replace(profile, launch_s=base, launch_prompt_s=per_prompt, meta=meta).write(args.profile)
        print(f"-> {args.profile}")


if __name__ == "__main__":
    main()
