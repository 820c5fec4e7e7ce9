"""Where the operator model's time goes in a simulated run: each step priced by `latency=operators`
is split by operator family (GEMMs, norms and the like, attention, LM head and sampler,
collectives, launch and host), summed over the steps with prefill and over the decode-only ones.

    python -m experiments.lab.operator_breakdown --bench model=qwen3-8b hardware=h200 parallel.tensor_parallel_size=4

`--bench` runs nano-vllm's benchmark as `experiments.bench_throughput` configures the engine
(experiments/lib/engine_bench.py `BASE`: 16,384 batched tokens, 512 sequences), in the simulator;
without it the overrides are the whole run (conf/config.yaml, `backend=sim latency=operators`
added; step by step, `backend.fast_forward=false`, which gives the same steps). Prints the run's
output throughput and the table; the run's traces go to --out.
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import pandas as pd

from experiments.lib.engine_bench import BASE
from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.run_workload import run
from sim.latency.base import BatchShape
from sim.latency.operators import OperatorModel


def breakdown(overrides: list[str], out: Path) -> tuple[dict, pd.DataFrame]:
    """The run's summary and its priced seconds by family (rows) and step kind (columns)."""
    booked: dict[str, dict[str, float]] = defaultdict(dict)
    priced = OperatorModel.shape_time

    def shape_time(model: OperatorModel, s: BatchShape, parts: dict[str, float] | None = None) -> float:
        kind = "steps with prefill" if s.num_prefill_tokens else "decode-only steps"
        return priced(model, s, booked[kind])

    OperatorModel.shape_time = shape_time  # type: ignore[method-assign]
    try:
        # Step by step: the fast-forward prices runs of decode steps ahead and keeps those it takes.
        summary = run(compose_cfg([*overrides, "backend=sim", "backend.fast_forward=false", "latency=operators",
                                   "progress=false", "plots=false"]), out, "operator_breakdown")
    finally:
        OperatorModel.shape_time = priced  # type: ignore[method-assign]
    table = pd.DataFrame(booked).fillna(0.0)
    table["all steps"] = table.sum(axis=1)
    table.loc["total"] = table.sum()
    return summary, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/config.yaml")
    ap.add_argument("--bench", action="store_true", help="bench_throughput's engine limits and workload first")
    ap.add_argument("--out", type=Path, default=Path("outputs/operator_breakdown"))
    a = ap.parse_args()
    base = [o for o in BASE if not o.startswith("backend=")] if a.bench else []
    try:
        summary, table = breakdown([*base, *a.overrides], a.out)
    except ValueError as e:  # a bad override or a profile that cannot price the run: said, no traceback
        raise SystemExit(f"error: {e}") from None
    r = summary["run"]
    print(f"output throughput {summary['output_throughput']:,.0f} tok/s; latency data: {r.get('latency_data', {})}")
    print("seconds priced, by operator family:")
    print(table.to_string(float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main()
