"""`python -m experiments.bench_serving [--out DIR] [OVERRIDES]`: a workload of conf/workload sent to
an OpenAI-compatible server on the loopback address, timed on the client.

The same as `python -m experiments.run backend=server [OVERRIDES]`: the workload (Poisson/Gamma
arrivals, length distributions, seed) is built from the config exactly as for the simulator and the
engine, sent as streaming token-id completions (experiments/lib/serving_client.py), and written as
`requests.parquet` + `summary.json` (TTFT, TPOT, ITL, E2E, request/token throughput, goodput) in
experiments.run's schema, so `experiments.ab`, the notebook and `experiments.lib.traces.load_runs`
compare it with a simulator run, an engine run or another server. `model=...` must match the
server's model (its vocabulary bounds the prompt token ids). Examples:

    python -m engine.serve --model qwen3-0.6b &                        # our server
    python -m experiments.bench_serving model=qwen3-0.6b workload=poisson workload.rate=20
    python -m experiments.bench_serving model=qwen3-0.6b backend.url=http://127.0.0.1:8001 \\
        workload=gamma backend.max_concurrency=64 slo.ttft_s=0.5
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.lib.cli import run_cli
from experiments.lib.fidelity_spec import compose_server_cfg
from experiments.lib.metrics import summary_table
from experiments.lib.run_dirs import default_run_dir
from experiments.lib.run_workload import run


def bench(overrides: Sequence[str], out: Path | None = None, label: str | None = None) -> dict[str, Any]:
    cfg = compose_server_cfg(overrides)
    out = out or default_run_dir("outputs/bench_serving")
    return run(cfg, out, label or (",".join(overrides) or "server"))


def _main() -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_serving", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/config.yaml (backend.url=..., workload=...)")
    ap.add_argument("--out", type=Path, default=None, help="run dir (default outputs/bench_serving/<date>/<time>)")
    a = ap.parse_args()
    out = a.out or default_run_dir("outputs/bench_serving")
    summary = bench(a.overrides, out)
    info = summary["run"]
    print(f"{summary['label']}: {info.get('served_model')} at {info.get('url')}, workload={info['workload']}, "
          f"{summary['completed']} / {summary['num_requests']} completed")
    for err in info.get("errors") or []:
        print(f"  error: {err}")
    print(summary_table(summary))
    print(f"  traces in {out}")


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
