"""`python -m experiments.bench_online [--out DIR] [OVERRIDES]`: online serving measured against the
in-process engine and the simulator, on one GPU, in one process lifetime (one engine throughout).

1. Throughput: nano-vllm's offline workload (256 requests) through `LLM.generate`, then the same
   requests through the HTTP server (`engine.serve`'s app, uvicorn in a thread of this process) as
   256 concurrent streaming clients (`experiments.bench_serving` in a subprocess, so the client
   does not share this process's interpreter). Output tok/s of each. `--frontend process` (the
   default, as `engine.serve`): the server's engine runs in its own process (built after the
   in-process runs release theirs, with the same KV block count, and warmed up with the same
   workload); `--frontend thread`: the server steps the in-process runs' engine in a thread.
2. TTFT at 0.3x capacity (capacity = step 1's in-process output tok/s / the stream's mean output
   length, as experiments.fidelity defines it): one Poisson stream through `backend=engine`
   (in-process) and through the server; TTFT p50 of each.
3. The serving path calibrated (experiments/lib/serving_calibration.py) from the 0.3x stream and a
   0.6x one through the server, never from the loads it predicts: each served request's client TTFT
   against the server's own (its `RequestStats`) gives the front end's delay per stream open and its
   jitter; client minus in-process TTFT at 0.3x gives the rest; mean TPOT there the ITL term.
4. The simulator predicting served latency: Poisson at 0.35x and 0.9x capacity through the server,
   and the same streams through `backend=sim latency=profiled` (the engine's KV block counts):
   plain, with a constant (step 2's TTFT p50 difference), and with the calibrated serving path
   (experiments/lib/serving_overhead.py); relative error of mean TPOT and p90 TTFT of each.
Both scheduling paths use the same scheduler config (async scheduling on, as conf/fidelity). Writes
`online.md` and `online.json` (device, date, command, every number) and each run's traces under
--out (default outputs/bench_online/<date>/<time>). Overrides are Hydra overrides of
conf/config.yaml for every run (e.g. `scheduler.async_scheduling=false`).

    python -m experiments.bench_online                         # on the GPU (about 4-6 minutes)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.lib import factory
from experiments.lib.engine_backend import device_name, engine_args, free_device, get_engine, release_engine
from experiments.lib.fidelity_report import relative_error
from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.request_timeline import TimedApp, hops, summary, with_client
from experiments.lib.run_dirs import default_run_dir
from experiments.lib.run_workload import run
from experiments.lib.serving_calibration import calibrate
from experiments.lib.traces import load_run
from policies.trace import TraceRecorder

# conf/fidelity's settings: the KV pool from GPU memory (not the default run's 3 GiB), async scheduling.
COMMON = ["model=qwen3-0.6b", "hardware=h200", "seed=0", "progress=false", "plots=false",
          "scheduler.async_scheduling=true", "blocks.kv_cache_gib=null"]
# Poisson streams with nano-vllm's length distribution (conf/fidelity's Poisson scenarios).
POISSON = ["workload=poisson", "workload.prompt_len.low=100", "workload.prompt_len.high=1024",
           "workload.output_len.low=100", "workload.output_len.high=1024"]
# load, requests; the first two calibrate the serving path, the last two are predicted.
LOADS = {"ttft_0.3x": (0.3, 100), "calib_0.6x": (0.6, 120), "poisson_0.35x": (0.35, 80), "poisson_0.9x": (0.9, 160)}
CALIBRATION = ("ttft_0.3x", "calib_0.6x")


def _server_run(url: str, overrides: list[str], out: Path) -> dict[str, Any]:
    """experiments.bench_serving against url, in a subprocess; its summary."""
    cmd = [sys.executable, "-m", "experiments.bench_serving", f"backend.url={url}", *overrides, "--out", str(out)]
    subprocess.run(cmd, check=True)
    return json.loads((out / "summary.json").read_text())


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_online", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/config.yaml for every run")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--frontend", choices=("process", "thread"), default="process",
                    help="the server's engine in its own process (default) or in a thread of this one")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply every request count (e.g. 0.05 for a smoke run on a small model)")
    a = ap.parse_args()
    out = a.out or default_run_dir("outputs/bench_online")
    out.mkdir(parents=True, exist_ok=True)
    common = [*COMMON, *a.overrides]
    started = time.time()

    # ---- 1. one engine: in-process LLM.generate, then the server over it ----------------------------
    from engine.offline.llm import LLM
    from engine.online.async_llm_engine import AsyncLLMEngine
    from engine.serving.app import build_app
    from engine.serving.server import ServerThread

    offline = ["workload=nanovllm", f"workload.num_requests={max(int(256 * a.scale), 2)}"]
    cfg = compose_cfg([*common, "backend=engine", *offline])
    workload = factory.workload(cfg)
    engine = get_engine(engine_args(cfg))

    def fresh_scheduler() -> None:  # the run config's scheduler (policy, limits, async scheduling)
        engine.reset(build_scheduler=lambda gpu, cpu, _: factory.build_scheduler(
            cfg, gpu, cpu, TraceRecorder(record_events=False)))

    llm = LLM.from_engine(engine)
    prompts = [r.prompt_token_ids for r in workload.requests]
    params = [r.sampling_params for r in workload.requests]
    fresh_scheduler()
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels compile for this run's shapes
    fresh_scheduler()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    in_process_tok_s = sum(o.num_output_tokens for o in outputs) / seconds
    print(f"in-process LLM.generate: {in_process_tok_s:,.0f} output tok/s ({seconds:.2f} s)", flush=True)
    mean_out = float(np.mean(workload.output_lens))

    results: dict[str, Any] = {"offline_requests": len(prompts), "in_process_tok_s": in_process_tok_s,
                               "in_process_s": seconds, "frontend": a.frontend}

    def stream_overrides(load: float, num: int) -> list[str]:
        num = max(int(num * a.scale), 2)
        stream_cfg = compose_cfg([*common, *POISSON, f"workload.num_requests={num}"])
        rate = load * in_process_tok_s / float(np.mean(factory.workload(stream_cfg).output_lens))
        return [*common, *POISSON, f"workload.num_requests={num}", f"workload.rate={rate:.6g}"]

    # ---- 2 (in-process half): the 0.3x stream through backend=engine ---------------------------------
    load, num = LOADS["ttft_0.3x"]
    eng = run(compose_cfg([*stream_overrides(load, num), "backend=engine"]), out / "ttft_0.3x_engine",
              "ttft_0.3x engine")
    gpu, cpu = engine.runner.num_gpu_blocks, engine.runner.num_cpu_blocks
    if a.frontend == "process":  # the server's engine gets the device to itself, with the same KV pool
        del llm, engine
        release_engine()
        free_device()
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            print(f"device memory free for the core process: {free / 2**30:.1f} of {total / 2**30:.1f} GiB",
                  flush=True)
        args = dataclasses.replace(engine_args(cfg), num_gpu_blocks=gpu)
        served = AsyncLLMEngine.from_engine_args(args, engine_process=True)
    else:
        served = AsyncLLMEngine(engine)
    server_stats: list = []  # the server's RequestStats of each ended request, for the calibration
    served.add_finished_observer(server_stats.append)

    timed = TimedApp(build_app(served, str(cfg.model.name)))  # each request's hops (request_timeline.py)
    with ServerThread(timed) as server:
        if a.frontend == "process":
            _server_run(server.url, [*common, *offline], out / "server_warmup")  # kernels compile in the core
        else:
            fresh_scheduler()
        s = _server_run(server.url, [*common, *offline], out / "server_offline")
        results["server_tok_s"] = s["output_throughput"]
        results["server_offline_completed"] = s["completed"]
        results["throughput_ratio"] = s["output_throughput"] / in_process_tok_s
        print(f"HTTP streaming: {s['output_throughput']:,.0f} output tok/s "
              f"({results['throughput_ratio']:.3f} of in-process)", flush=True)

        # ---- 2-4: Poisson streams at loads of the capacity ----------------------------------------------
        variants: dict[str, list[str]] = {"sim": []}  # the simulator's runs of each predicted stream
        served_points: dict[str, tuple] = {}
        for name, (load, num) in LOADS.items():
            overrides = stream_overrides(load, num)
            if a.frontend == "thread":
                fresh_scheduler()
            server_stats.clear()
            timed.times.clear()
            srv = _server_run(server.url, overrides, out / f"{name}_server")
            row: dict[str, Any] = {"load": load, "rate_req_s": float(overrides[-1].split("=")[1]),
                                   "requests": int(overrides[-2].split("=")[1]), "server": _latencies(srv)}
            row["timeline"] = summary(with_client(hops(timed.times, server_stats),
                                                  load_run(out / f"{name}_server").requests))
            if name in CALIBRATION:
                served_points[name] = (load_run(out / f"{name}_server").requests, list(server_stats))
            if name == CALIBRATION[0]:
                row["engine"] = _latencies(eng)
                row["ttft_p50_diff_ms"] = row["server"]["ttft_p50_ms"] - row["engine"]["ttft_p50_ms"]
                itl = srv["tpot"]["mean"] - eng["tpot"]["mean"]
                variants["sim_constant"] = [f"serving.ttft_overhead_s={max(row['ttft_p50_diff_ms'] / 1e3, 0.0):.6g}",
                                            f"serving.itl_overhead_s={max(itl, 0.0):.6g}"]
            if name == CALIBRATION[-1]:
                calib = calibrate(served_points, CALIBRATION[0], load_run(out / f"{CALIBRATION[0]}_engine").requests, itl)
                results["serving_path"] = dataclasses.asdict(calib)
                variants["sim_serving"] = calib.overrides()
                print(f"serving path: {json.dumps(results['serving_path'])}", flush=True)
            if name not in CALIBRATION:
                sim_cfg = [*overrides, "backend=sim", "latency=profiled", f"blocks.num_gpu_blocks={gpu}",
                           f"blocks.num_cpu_blocks={cpu}"]
                for key, extra in variants.items():
                    sim = run(compose_cfg([*sim_cfg, *extra]), out / f"{name}_{key}", f"{name} {key}")
                    row[key] = _latencies(sim)
                    row[key]["tpot_mean_error"] = relative_error(sim["tpot"]["mean"], srv["tpot"]["mean"])
                    row[key]["ttft_p90_error"] = relative_error(sim["ttft"]["p90"], srv["ttft"]["p90"])
                row["tpot_mean_error"] = row["sim_serving"]["tpot_mean_error"]
                row["ttft_p90_error"] = row["sim_serving"]["ttft_p90_error"]
            results[name] = row
            print(f"{name}: {json.dumps(row)}", flush=True)
    if a.frontend == "process":
        free_device()

    meta = {"device": device_name(), "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m experiments.bench_online " + " ".join(sys.argv[1:]), "overrides": common,
            "wall_s": time.time() - started, "mean_output_len_offline": mean_out}
    (out / "online.json").write_text(json.dumps({**meta, **results}, indent=2) + "\n")
    (out / "online.md").write_text(report(meta, results))
    print(report(meta, results))
    print(f"traces in {out}")


def _latencies(summary: dict[str, Any]) -> dict[str, Any]:
    return {"completed": summary["completed"], "output_tok_s": summary["output_throughput"],
            "ttft_p50_ms": _ms(summary["ttft"]["median"]), "ttft_p90_ms": _ms(summary["ttft"]["p90"]),
            "tpot_mean_ms": _ms(summary["tpot"]["mean"]), "itl_mean_ms": _ms(summary["itl"]["mean"]),
            "e2e_mean_ms": _ms(summary["e2e"]["mean"])}


def report(meta: dict[str, Any], r: dict[str, Any]) -> str:
    def pct(x: float) -> str:
        return f"{100 * x:+.1f}%"
    t = r["ttft_0.3x"]
    lines = [
        "# Online serving vs in-process vs simulator", "",
        f"Device {meta['device']}, {meta['date']}, `{meta['command']}` ({meta['wall_s']:.0f} s).", "",
        "| measurement | value | target |", "|---|---|---|",
        f"| nano-vllm, {r['offline_requests']} requests, in-process LLM.generate | {r['in_process_tok_s']:,.0f} tok/s | |",
        (f"| same, HTTP streaming ({r['offline_requests']} concurrent clients, engine in a {r['frontend']}) | "
         f"{r['server_tok_s']:,.0f} tok/s "
        f"({r['throughput_ratio']:.3f}x) | >= 0.90x |"),
        (f"| TTFT p50 at 0.3x capacity: server / in-process | {t['server']['ttft_p50_ms']:.1f} / "
        f"{t['engine']['ttft_p50_ms']:.1f} ms ({t['ttft_p50_diff_ms']:+.2f} ms) | <= +2 ms |"),
    ]
    tl = t.get("timeline")
    if tl and tl.get("requests"):
        lines.append(
            f"| TTFT at 0.3x, hop by hop (p50 of {tl['requests']} requests): HTTP in to generate() / engine / "
            f"first token to chunk written / client and transport | {tl['way_in']['p50_ms']:.2f} / "
            f"{tl['engine']['p50_ms']:.2f} / {tl['way_out']['p50_ms']:.2f} / {tl['client_rest']['p50_ms']:.2f} ms | |")
    c = r["serving_path"]
    jitter = c["ttft_jitter_s"]
    p10, p90 = np.interp([0.1, 0.9], (np.arange(len(jitter)) + 0.5) / len(jitter), jitter)
    lines.append(
        f"| serving path from {c['num_samples']} served requests at 0.3x and 0.6x (mean streams "
        f"{', '.join(f'{v:.1f}' for v in c['mean_streams'].values())}) | TTFT + {1e3 * c['ttft_overhead_s']:.2f} ms "
        f"+ {1e6 * c['ttft_per_stream_s']:.1f} us per open stream + jitter (p10 {1e3 * p10:+.2f}, p90 "
        f"{1e3 * p90:+.2f} ms); ITL + {1e3 * c['itl_overhead_s']:.3f} ms | |")
    for name in ("poisson_0.35x", "poisson_0.9x"):
        p = r[name]
        model, const, plain = p["sim_serving"], p["sim_constant"], p["sim"]
        for metric, label, unit, target in (("tpot_mean", "mean TPOT", ".2f", "5%"), ("ttft_p90", "p90 TTFT", ".1f", "10%")):
            lines.append(
                f"| {name}: {label} sim (serving path) vs server | {model[metric + '_ms']:{unit}} vs "
                f"{p['server'][metric + '_ms']:{unit}} ms ({pct(model[metric + '_error'])}; constant "
                f"{pct(const[metric + '_error'])}, plain sim {pct(plain[metric + '_error'])}) | within {target} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
