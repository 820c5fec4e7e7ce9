"""`python -m experiments.bench_frontend [--clients 64 256] [--modes thread process]`: what the HTTP front
end costs the engine, with the engine in a thread of the server's process or in its own process.

For each mode and client count: the engine alone (`in-process`: LLMEngine stepped with the same
requests, no server), or the server (`build_app` over `AsyncLLMEngine`, uvicorn in a thread of
this process) serves that many concurrent streaming clients (`experiments.bench_serving` in a
subprocess, every request at t = 0), and the engine's steps per second (`stats().num_steps_total`
over the client's active window) and the clients' output tok/s are reported. The default model is
tiny-llama on CPU, a proxy where each step's model work is small next to the host work of 64-256
streams (on a GPU, `experiments.bench_online` measures the real thing). Scratch output under --out
(default outputs/bench_frontend/<date>/<time>).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

from engine.async_llm_engine import AsyncLLMEngine
from engine.engine_args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.serving.app import build_app
from engine.serving.server import ServerThread


def workload_overrides(args: EngineArgs, clients: int, output_len: int) -> list[str]:
    return [f"model={args.model_config().name}", "workload=offline", f"workload.num_requests={clients}",
            "workload.prompt_len.low=16", "workload.prompt_len.high=64", f"workload.output_len.low={output_len}",
            f"workload.output_len.high={output_len}", "workload.vocab_size=200", "workload.seed=0",
            f"backend.max_concurrency={clients}", "progress=false", "plots=false"]


def in_process(args: EngineArgs, clients: int, output_len: int) -> dict:
    """The same requests stepped by LLMEngine alone (no server): the steps/s the server's engine
    would make without a front end."""
    from experiments.bench_serving import compose_server_cfg
    from experiments.lib import factory

    workload = factory.workload(compose_server_cfg(workload_overrides(args, clients, output_len)))
    engine = LLMEngine(args)
    for warm in (True, False):
        for i, r in enumerate(workload.requests[:8] if warm else workload.requests):
            engine.add_request(f"{warm}-{i}", r.prompt_token_ids, r.sampling_params)
        steps, tokens, t0 = 0, 0, time.perf_counter()
        while engine.has_unfinished_requests():
            tokens += sum(o.num_output_tokens for o in engine.step() if o.finished)
            steps += 1
        seconds = time.perf_counter() - t0
    return {"mode": "in-process", "clients": clients, "completed": len(workload.requests),
            "steps_per_s": steps / seconds, "output_tok_s": tokens / seconds, "tpot_mean_ms": float("nan"),
            "active_s": seconds, "wall_s": seconds}


def one_run(args: EngineArgs, mode: str, clients: int, output_len: int, out: Path) -> dict:
    if mode == "in-process":
        return in_process(args, clients, output_len)
    engine = AsyncLLMEngine.from_engine_args(args, engine_process=True) if mode == "process" else \
        AsyncLLMEngine(LLMEngine(args))
    with ServerThread(build_app(engine, args.model_config().name)) as server:
        def cmd(n: int, run_out: Path) -> list[str]:
            overrides = workload_overrides(args, clients, output_len)
            overrides[2] = f"workload.num_requests={n}"
            return [sys.executable, "-m", "experiments.bench_serving", f"backend.url={server.url}", *overrides,
                    "--out", str(run_out)]

        subprocess.run(cmd(8, out / "warmup"), check=True, capture_output=True)
        steps0, t0 = engine.stats().num_steps_total, time.perf_counter()
        subprocess.run(cmd(clients, out), check=True, capture_output=True)
        seconds, steps = time.perf_counter() - t0, engine.stats().num_steps_total - steps0
    summary = json.loads((out / "summary.json").read_text())
    # The client's active window (sending the first request to the last token), not the wall time
    # around it, which holds the client subprocess's start-up.
    active_s = summary["total_output_tokens"] / summary["output_throughput"]
    return {"mode": mode, "clients": clients, "completed": summary["completed"], "steps_per_s": steps / active_s,
            "output_tok_s": summary["output_throughput"], "tpot_mean_ms": 1e3 * summary["tpot"]["mean"],
            "active_s": active_s, "wall_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_frontend", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--modes", nargs="+", default=["in-process", "thread", "process"],
                    choices=["in-process", "thread", "process"])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode and client count (modes alternate)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    out = a.out or Path("outputs/bench_frontend") / dt.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    args = EngineArgs(model=a.model, device=a.device, num_gpu_blocks=4096, max_model_len=512, max_num_seqs=256)
    rows = []
    for clients in a.clients:
        for r in range(a.repeats):
            for mode in a.modes:
                row = one_run(args, mode, clients, a.output_len, out / f"{mode}_{clients}_{r}")
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out / "frontend.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| clients | mode | steps/s | output tok/s | mean TPOT ms |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['clients']} | {row['mode']} | {row['steps_per_s']:.1f} | {row['output_tok_s']:,.0f} | "
              f"{row['tpot_mean_ms']:.2f} |")


if __name__ == "__main__":
    main()
