"""`python -m experiments.run [overrides]`: one run of a workload through a backend (Hydra app).

Writes requests.parquet, steps.parquet, events.parquet, summary.json and PNG plots into Hydra's
run dir (`outputs/<date>/<time>/`, or `multirun/<date>/<time>/<job>/` with `-m`), shows a progress
bar and prints a summary table. Examples:

    python -m experiments.run policy=fcfs
    python -m experiments.run -m policy=fcfs,priority workload.rate=1,2,4
    python -m experiments.run blocks=contiguous workload=sharegpt workload.max_tokens=2048
"""
from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.lib.cli import config_errors, run_cli
from experiments.lib.metrics import summary_table
from experiments.lib.run_workload import run


def _label() -> str:
    hc = HydraConfig.get()
    return hc.job.override_dirname or "default"


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
@config_errors
def _main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    label = _label()
    summary = run(cfg, out_dir, label)
    r = summary["run"]
    print(f"{label}: {r['policy']}/{r['preemption_mode']}, blocks={r['blocks']}, workload={r['workload']}, "
          f"backend={r['backend']}{' (' + r['decode_kernel'] + ' decode kernel)' if 'decode_kernel' in r else ''} "
          f"({r['num_steps']} steps, {r['wall_time_s']:.2f}s wall)")
    print(summary_table(summary))
    print(f"  traces and plots in {out_dir}")


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
