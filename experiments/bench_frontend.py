"""`python -m experiments.bench_frontend [--clients 64 256] [--modes thread process]`: what the HTTP front
end costs the engine, with the engine in a thread of the server's process or in its own process;
`--latency [--baseline REF]`: what it adds to the time to the first token, layer by layer.

For each mode and client count: the engine alone (`in-process`: LLMEngine stepped with the same
requests, no server), or the server (`build_app` over `AsyncLLMEngine`, uvicorn in a thread of
this process) serves that many concurrent streaming clients (`experiments.bench_serving` in a
subprocess, every request at t = 0), and the engine's steps per second (`stats().num_steps_total`
over the client's active window) and the clients' output tok/s are reported. The default model is
tiny-llama on CPU, a proxy where each step's model work is small next to the host work of 64-256
streams (on a GPU, `experiments.bench_online` measures the real thing). Scratch output under --out
(default outputs/bench_frontend/<date>/<time>).

`--latency` times single requests on an idle server through each layer (experiments/lib/
frontend_latency.py: the engine alone, AsyncLLMEngine in a thread and with its own process, HTTP
from a raw-socket client and from aiohttp, uvicorn on plain asyncio + h11, the engine in the
server's thread) and prints each layer's TTFT and what it adds over the engine's; `--baseline REF`
measures the tree of commit REF in the same run, rounds alternating (before / after a change).

`--front-cpu [--baseline REF]` times the front end's own CPU per streamed request: the app called
as uvicorn calls it, over a host that answers at once (experiments/lib/frontend_cpu.py, its
stand-ins in frontend_host_stub.py: no socket, no process hop, no model), so what it measures is the event loop's work on the way to the first
chunk (body parsing and checks, the request handed over, the chunk built), with little noise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from engine.online.async_llm_engine import AsyncLLMEngine
from engine.serving.app import build_app
from engine.serving.server import ServerThread
from experiments.lib.run_dirs import default_run_dir


def workload_overrides(args: EngineArgs, clients: int, output_len: int) -> list[str]:
    return [f"model={args.model_config().name}", "workload=offline", f"workload.num_requests={clients}",
            "workload.prompt_len.low=16", "workload.prompt_len.high=64", f"workload.output_len.low={output_len}",
            f"workload.output_len.high={output_len}", "workload.vocab_size=200", "workload.seed=0",
            f"backend.max_concurrency={clients}", "progress=false", "plots=false"]


def in_process(args: EngineArgs, clients: int, output_len: int) -> dict:
    """The same requests stepped by LLMEngine alone (no server): the steps/s the server's engine
    would make without a front end."""
    from experiments.lib import factory
    from experiments.lib.fidelity_spec import compose_server_cfg

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


def _probe_trees(probe_module, out: Path, baseline: str | None, rounds: int, args: list[str],
                 beside: tuple = ()) -> dict[str, list[dict]]:
    """Run the probe (a copy of `probe_module`'s file outside any package, with copies of the
    `beside` modules' files next to it, which it imports by file name) `rounds` times for each tree
    (REF's, extracted with `git archive`, and this one), alternating; each run's JSON per tree."""
    import shutil
    import tempfile

    from experiments.lib import baseline_tree

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="frontend_probe_"))
    probe = work / Path(probe_module.__file__).name
    shutil.copy(probe_module.__file__, probe)
    for module in beside:
        shutil.copy(module.__file__, work / Path(module.__file__).name)
    root = Path(__file__).resolve().parent.parent
    trees = {"this tree": root}
    if baseline is not None:
        tree = baseline_tree.extract(baseline, work / "baseline")
        trees = {f"baseline {baseline}": tree, **trees}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(rounds):
        for name, tree in trees.items():
            path = out / f"{probe.stem}_{name.split()[-1].replace(' ', '_')}_{r}.json"
            env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            subprocess.run([sys.executable, str(probe), "--out", str(path), *args], check=True, env=env, cwd=work)
            runs[name].append(json.loads(path.read_text()))
            print(f"round {r} {name}: done", flush=True)
    shutil.rmtree(work)
    return runs


def latency(out: Path, baseline: str | None, rounds: int, requests: int, background: int,
            prompt_len: int = 32) -> None:
    """Each tree (REF's and this one) `rounds` times, alternating."""
    from experiments.lib import frontend_latency

    runs = _probe_trees(frontend_latency, out, baseline, rounds,
                        ["--requests", str(requests), "--background", str(background), "--prompt-len", str(prompt_len)])
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in runs}
    chunk_cost: dict[str, dict[str, list[float]]] = {name: {} for name in runs}
    for name, results in runs.items():
        for result in results:
            for key, value in result.items():
                if key == "frontend_us_per_chunk":
                    for k, v in value.items():
                        chunk_cost[name].setdefault(k, []).append(v)
                else:
                    samples[name].setdefault(key, []).extend(value)
    print(latency_table(samples, chunk_cost))
    (out / "latency.json").write_text(json.dumps({"samples": samples, "frontend_us_per_chunk": chunk_cost}) + "\n")


def front_cpu(out: Path, baseline: str | None, rounds: int, requests: int, prompt_len: int, tokens: int) -> None:
    """The front end's own CPU per request (experiments/lib/frontend_cpu.py), each tree `rounds`
    times, alternating; p50 per tree and the change."""
    import numpy as np

    from experiments.lib import frontend_cpu, frontend_host_stub

    runs = _probe_trees(frontend_cpu, out, baseline, rounds, ["--requests", str(requests), "--prompt-len", str(prompt_len), "--tokens", str(tokens)],
                        beside=(frontend_host_stub,))
    keys = list(next(iter(runs.values()))[0])
    lines = ["| tree | " + " | ".join(f"{k} p50 (us)" for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, results in runs.items():
        cells = [f"{1e6 * np.median([x for r in results for x in r[k]]):.1f}" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    (out / "front_cpu.json").write_text(json.dumps(runs) + "\n")


def latency_table(samples: dict[str, dict[str, list[float]]], chunk_cost: dict[str, dict[str, list[float]]]) -> str:
    import numpy as np

    names = list(samples)
    lines = ["| path | " + " | ".join(f"{n}: TTFT p50 (p10) ms, added over engine p50" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for path in samples[names[-1]]:
        cells = []
        for n in names:
            got = samples[n].get(path)
            if not got:
                cells.append("-")
                continue
            p50, p10 = np.percentile(got, 50), np.percentile(got, 10)
            added = p50 - np.percentile(samples[n]["engine"], 50)
            cells.append(f"{1e3 * p50:.3f} ({1e3 * p10:.3f}), {1e3 * added:+.3f}")
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    # Client minus the server's own TTFT of the same request (the way in before generate() and the
    # first output's way back), free of the engine's step time, which dominates with long prompts.
    for path in [p for p in samples[names[-1]] if f"{p}_own" in samples[names[-1]]]:
        cells = []
        for n in names:
            client, own = samples[n].get(path, []), samples[n].get(f"{path}_own", [])
            paired = len(client) == len(own) and client
            cells.append(f"{1e3 * np.median(np.subtract(client, own)):.3f}" if paired else "-")
        lines.append(f"| {path} minus the server's own, paired median (ms) | " + " | ".join(cells) + " |")
    for path in chunk_cost[names[-1]]:
        cells = [f"{np.median(chunk_cost[n][path]):.1f} us" if chunk_cost[n].get(path) else "-" for n in names]
        lines.append(f"| front end CPU per streamed chunk, {path} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_frontend", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--modes", nargs="+", default=["in-process", "thread", "process"],
                    choices=["in-process", "thread", "process"])
    ap.add_argument("--output-len", type=int, default=None,
                    help="output tokens per request (64; --front-cpu: 4, one chunk each)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode and client count (modes alternate)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--latency", action="store_true", help="TTFT added per layer (see above) instead")
    ap.add_argument("--front-cpu", action="store_true",
                    help="the front end's own CPU per request (no sockets, no engine) instead")
    ap.add_argument("--baseline", default=None, help="with --latency or --front-cpu: also measure this commit's tree")
    ap.add_argument("--rounds", type=int, default=3,
                    help="with --latency or --front-cpu: runs per tree (trees alternate)")
    ap.add_argument("--requests", type=int, default=None,
                    help="with --latency: requests per path and run (200); --front-cpu: per run (2000)")
    ap.add_argument("--background", type=int, default=16,
                    help="with --latency: streams for the front end's CPU per chunk (0: skip)")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="with --latency (32; up to 1,800 on tiny-llama) or --front-cpu (560): token ids per "
                         "prompt (the path's cost grows with it)")
    a = ap.parse_args()
    out = a.out or default_run_dir("outputs/bench_frontend")
    if a.front_cpu:
        front_cpu(out, a.baseline, a.rounds, a.requests or 2000, a.prompt_len or 560, a.output_len or 4)
        return
    if a.latency:
        latency(out, a.baseline, a.rounds, a.requests or 200, a.background, a.prompt_len or 32)
        return
    args = EngineArgs(model=a.model, device=a.device, num_gpu_blocks=4096, max_model_len=512, max_num_seqs=256)
    rows = []
    for clients in a.clients:
        for r in range(a.repeats):
            for mode in a.modes:
                row = one_run(args, mode, clients, a.output_len or 64, out / f"{mode}_{clients}_{r}")
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out / "frontend.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| clients | mode | steps/s | output tok/s | mean TPOT ms |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['clients']} | {row['mode']} | {row['steps_per_s']:.1f} | {row['output_tok_s']:,.0f} | "
              f"{row['tpot_mean_ms']:.2f} |")


if __name__ == "__main__":
    main()
