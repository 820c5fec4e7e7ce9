"""`python -m experiments.search [overrides]`: the cheapest deployment that meets the SLOs (Hydra app,
config conf/search.yaml; docs/search.md).

Searches GPU type x tensor-parallel size x replicas x max_num_seqs x max_num_batched_tokens x policy
x router; for each deployment, the highest request rate it sustains within `search.slo`, its $/h and
its cost per million output tokens. Writes table.csv / table.parquet, pareto.png and summary.json
into outputs/search/<date>/<time>/ and prints the cheapest deployment for `search.target_rate`.
Examples:

    python -m experiments.search model=qwen3-8b workload=sharegpt workload.num_requests=100
    python -m experiments.search search.n_jobs=2 search.target_rate=20 search.slo.ttft_s=1
"""
from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.lib.cli import config_errors, run_cli
from experiments.lib.search.outputs import describe, largest_capacity
from experiments.lib.search.runner import run_search
from experiments.lib.search.status import LOWER_BOUND, status_lines


@hydra.main(config_path="../conf", config_name="search", version_base="1.3")
@config_errors
def _main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    result = run_search(cfg, out_dir)
    s = result.summary
    print(f"{s['deployments']} deployments of {s['model']} ({s['simulated']} simulated, {s['cached']} cached, "
          f"{s['pruned']} pruned), {s['simulations']} simulations ({s['simulated_requests']} requests); SLO: "
          f"{s['slo_text']}")
    for line in status_lines(result.table, s):
        print(f"  {line}")
    c = result.cheapest
    if c is None:
        print(f"no deployment sustains search.target_rate={s['target_rate']:g} req/s: "
              f"{largest_capacity(result.table, s['max_iterations'])}")
    else:
        bound = c["capacity_status"] == LOWER_BOUND
        print(f"cheapest for {s['target_rate']:g} req/s: {describe(c)}: {c['num_gpus']} GPUs, "
              f"${c['dollars_per_hour']:.2f}/h, capacity {'>= ' if bound else ''}{c['capacity_rps']:.3g} req/s, "
              f"{'at most ' if bound else ''}${c['cost_per_million_output_tokens']:.3f} per million output tokens")
        failed = ("no rate tried failed (a lower bound)" if c["failed_rps"] is None else
                  f"failed at {c['failed_rps']:.3g} req/s ({int(c['failed_num_requests'])} requests): {c['failed_because']}")
        print(f"  met at {c['capacity_rps']:.3g} req/s ({int(c['num_requests'])} requests, capacity_status="
              f"{c['capacity_status']}); {failed}")
    bounds = int((result.front["capacity_status"] == LOWER_BOUND).sum())
    print(f"  Pareto front: {len(result.front)} deployments{f' ({bounds} at a lower bound)' if bounds else ''}; table, pareto.png and summary.json in {out_dir}")


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
