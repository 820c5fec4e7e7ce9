"""`python -m experiments.disagg_sweep [overrides]`: goodput per GPU of prefill/decode splits against
co-located (mixed) replicas across TPOT SLOs, and the TPOT where the better one changes (Hydra app,
config conf/disagg_sweep.yaml, which takes conf/search.yaml whole; docs/disaggregation.md).

    python -m experiments.disagg_sweep                                  # Qwen3-0.6B on 2 x H200
    python -m experiments.disagg_sweep model=llama-3.1-70b latency=operators \\
        search.space.tensor_parallel_size=[2] search.space.replicas=[4] \\
        "search.space.pd_split=[mixed,1:3,2:2,3:1]" "sweep.tpot_s=[0.03,0.05,0.1]"

Writes sweep.csv (every deployment at every TPOT), best.csv (per TPOT: the best of each kind and the
winner) and each point's search outputs under tpot_<ms>ms/ into outputs/disagg_sweep/<date>/<time>/.
"""
from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.lib.cli import config_errors, run_cli
from experiments.lib.search.pd_sweep import best_per_tpot, crossovers, pd_sweep


@hydra.main(config_path="../conf", config_name="disagg_sweep", version_base="1.3")
@config_errors
def _main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    sweep = pd_sweep(cfg, out_dir, progress=bool(cfg.get("progress", False)))
    best = best_per_tpot(sweep)
    sweep.to_csv(out_dir / "sweep.csv", index=False)
    best.to_csv(out_dir / "best.csv", index=False)
    print(f"{cfg.model.name} on {', '.join(cfg.search.space.gpu)}; SLO: goodput >= {cfg.search.slo.goodput} of "
          f"requests with TTFT <= {cfg.search.slo.ttft_s} s and TPOT <= the row's")
    print(sweep.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(best.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    for lo, hi, winner in crossovers(best):
        print(f"crossover between TPOT {lo:g} ms and {hi:g} ms: {winner} wins above")
    print(f"sweep.csv, best.csv in {out_dir}")


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
