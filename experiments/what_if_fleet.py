"""`python -m experiments.what_if_fleet [--out DIR] [OVERRIDES]`: GPU types compared as fleets by the
capacity search (docs/what-if-70b-fleet.md): Llama-3.1-70B on H100 and H200 by default.

Runs `experiments.search` once per latency model: the roofline over every GPU type of the space, and
the operator model over the GPU types that have an operator profile (`<latency.dir>/<gpu>-<dtype>-*.csv`),
its collectives measured where the profile has them and priced from the interconnect elsewhere
(`latency.collectives=measured_else_ring`, labelled per row; `latency.collectives=measured` prunes
the tensor-parallel sizes without collective data instead). Writes each search's
outputs into `<out>/<latency>/`, `fleet.csv` (both tables, a `latency` column added) and
`what_if.md`: per GPU type and latency model the data it rests on, the lowest cost per million
output tokens, the largest capacity and the cheapest deployment for the target rate. OVERRIDES are
`experiments.search` overrides over the defaults below (e.g. `search.target_rate=40`). An operator
profile added later (an H100 one) is picked up by running the same command again.

    python -m experiments.what_if_fleet --out experiments/results/what_if_70b_fleet
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.lib.cli import run_cli
from experiments.lib.paths import REPO_ROOT
from experiments.lib.search.outputs import describe
from experiments.lib.search.runner import run_search

DEFAULTS = ["model=llama-3.1-70b", "workload=sharegpt", "search.duration_s=20", "search.slo.ttft_s=1",
            "search.slo.tpot_s=0.05", "search.target_rate=20", "search.space.gpu=[h100,h200]",
            "search.space.tensor_parallel_size=[2,4,8]", "search.space.replicas=[1,2,4]",
            "search.space.max_num_seqs=[64,256]", "search.space.max_num_batched_tokens=[2048]",
            "search.space.policy=[fcfs]", "search.space.router=[round_robin]", "search.rate.start_per_replica=4",
            "search.rate.growth=2", "search.rate.max_iterations=8"]


def operator_files(cfg, gpu_hardware: str) -> list[Path]:
    """The operator profile files the operator model would read for this GPU (compute and collectives)."""
    directory = Path(str(cfg.latency.dir))
    if not directory.is_absolute() and not directory.is_dir():
        directory = REPO_ROOT / directory
    return sorted(directory.glob(f"{gpu_hardware}-{cfg.model.dtype}-*.csv"))


OPERATOR_DEFAULTS = ["latency.collectives=measured_else_ring"]


def collectives_label(latency_data: str) -> str:
    """The collectives' source of a table row's `latency_data`, without the files and figures."""
    for part in str(latency_data).split("; "):
        if part.startswith("collectives: "):
            return part.removeprefix("collectives: ").split(" (", 1)[0]
    return ""


def data_basis(cfg, hardware: str, latency: str, rows: pd.DataFrame) -> str:
    """What one GPU type's rows rest on; `rows` its deployments (their `latency_data`)."""
    if latency == "roofline":
        return (f"roofline over conf/hardware/{hardware}.yaml (peaks and efficiencies; all-reduce from the "
                "datasheet NVLink bandwidth and latency)")
    files = operator_files(cfg, hardware)
    compute = [f.name for f in files if "collectives" not in f.stem]
    collective_files = [f.name for f in files if "collectives" in f.stem]
    per_tp = []
    for tp, t in rows.groupby("tensor_parallel_size"):
        label = next((collectives_label(x) for x in t.get("latency_data", pd.Series(dtype=str)).fillna("")
                      if collectives_label(x)), "")
        per_tp.append(f"TP {tp}: {label or 'pruned: ' + str(t['reason'].iloc[0])[:60]}")
    return (f"operators timed on the GPU ({', '.join(compute)}); collective rows: "
            f"{', '.join(collective_files) or 'none'}; collectives priced as {'; '.join(per_tp)}")


def summarise(table: pd.DataFrame, target: float) -> list[dict]:
    rows = []
    for (latency, gpu), t in table.groupby(["latency", "gpu"], sort=False):
        ran = t[t["capacity_rps"] > 0]
        able = ran[ran["capacity_rps"] >= target].sort_values(["dollars_per_hour", "capacity_rps"],
                                                               ascending=[True, False], kind="stable")
        best_cost = ran.loc[ran["cost_per_million_output_tokens"].idxmin()] if not ran.empty else None
        cheap = able.iloc[0] if not able.empty else None
        rows.append({"latency": latency, "gpu": gpu, "basis": t["basis"].iloc[0],
                     "simulated": len(ran), "pruned": int((t["status"] == "pruned").sum()),
                     "best_cost": best_cost, "max_capacity": ran["capacity_rps"].max() if not ran.empty else 0.0,
                     "cheapest": cheap})
    return rows


def markdown(rows: list[dict], target: float, slo_text: str, workload: str, model: str) -> str:
    lines = [f"{model}, workload {workload}, SLO {slo_text}; target {target:g} req/s.", "",
             "| GPU | latency model | rests on | deployments simulated / pruned |", "|---|---|---|---:|"]
    lines += [f"| {r['gpu']} | {r['latency']} | {r['basis']} | {r['simulated']} / {r['pruned']} |" for r in rows]
    lines += ["", "| GPU | latency model | lowest $ per million output tokens (deployment, capacity per GPU) | largest "
              f"capacity (req/s) | cheapest for {target:g} req/s |", "|---|---|---|---:|---|"]
    for r in rows:
        b, c = r["best_cost"], r["cheapest"]
        best = "none" if b is None else (f"${b['cost_per_million_output_tokens']:.3f}: {short(b)}, "
                                         f"{b['capacity_rps'] / b['num_gpus']:.2f} req/s per GPU")
        gpus = "" if c is None else f"{int(c['num_gpus'])} GPU{'s' if int(c['num_gpus']) != 1 else ''}"
        cheap = "none reaches it" if c is None else (f"{short(c)}: {gpus}, ${c['dollars_per_hour']:.2f}/h, "
                                                     f"{c['capacity_rps']:.3g} req/s")
        lines.append(f"| {r['gpu']} | {r['latency']} | {best} | {r['max_capacity']:.3g} | {cheap} |")
    return "\n".join(lines) + "\n"


def per_tp(table: pd.DataFrame) -> str:
    """One replica per GPU type, latency model and TP size: the max_num_seqs of the lowest cost per
    million output tokens (a fleet of n replicas is about n times the capacity at the same cost)."""
    one = table[(table["replicas"] == 1)]
    lines = ["| GPU | latency model | TP | collectives | $/h | capacity (req/s) | $ per million output tokens | "
             "max_num_seqs | TTFT / TPOT at capacity (p) |", "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for (latency, gpu, tp), t in one.groupby(["latency", "gpu", "tensor_parallel_size"], sort=False):
        ran = t[t["capacity_rps"] > 0]
        if ran.empty:
            why = str(t["reason"].iloc[0])
            reason = (f"pruned: no collective data at N = {tp}" if why.startswith("latency") else
                      "pruned: does not fit" if why.startswith("memory") else "met the SLOs at no rate")
            lines.append(f"| {gpu} | {latency} | {tp} | | {t['dollars_per_hour'].iloc[0]:.2f} | {reason} | | | |")
            continue
        r = ran.loc[ran["cost_per_million_output_tokens"].idxmin()]
        comm = collectives_label(r.get("latency_data", "")) or "ring model, datasheet"
        lines.append(f"| {gpu} | {latency} | {tp} | {comm} | {r['dollars_per_hour']:.2f} | {r['capacity_rps']:.3g} | "
                     f"{r['cost_per_million_output_tokens']:.3f} | {int(r['max_num_seqs'])} | "
                     f"{r['ttft_p']:.2f} s / {r['tpot_p'] * 1e3:.1f} ms |")
    return "\n".join(lines) + "\n"


def short(row: pd.Series) -> str:
    return f"{int(row['replicas'])} x TP{int(row['tensor_parallel_size'])}, max_num_seqs {int(row['max_num_seqs'])}"


def _main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(prog="python -m experiments.what_if_fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="experiments.search overrides over the defaults")
    parser.add_argument("--out", type=Path, default=Path("outputs/what_if_fleet"), help="output folder")
    args = parser.parse_args(argv)
    tables = []
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        base = compose("search", [*DEFAULTS, *args.overrides])
        catalogue = OmegaConf.to_container(base.catalogue.gpus, resolve=True)
        gpus = list(base.search.space.gpu)
        ops = [*DEFAULTS, "latency=operators", *OPERATOR_DEFAULTS, *args.overrides]
        with_ops = [g for g in gpus if operator_files(compose("search", ops), catalogue[g]["hardware"])]
        for latency, searched, overrides in (("roofline", gpus, [*DEFAULTS, *args.overrides, "latency=roofline"]),
                                             ("operators", with_ops, ops)):
            if not searched:
                print(f"{latency}: no GPU type of {gpus} has data; skipped")
                continue
            cfg = compose("search", [*overrides, f"search.space.gpu=[{','.join(searched)}]"])
            result = run_search(cfg, args.out / latency)
            t = result.table.assign(latency=latency)
            t["basis"] = t["gpu"].map({g: data_basis(cfg, catalogue[g]["hardware"], latency, rows)
                                       for g, rows in t.groupby("gpu")})
            tables.append(t)
            print(f"{latency}: {len(t)} deployments; cheapest for {cfg.search.target_rate:g} req/s: "
                  f"{describe(result.cheapest) if result.cheapest else 'none'}")
    table = pd.concat(tables, ignore_index=True)
    table.to_csv(args.out / "fleet.csv", index=False)
    s = result.summary
    text = markdown(summarise(table, float(s["target_rate"])), float(s["target_rate"]), s["slo_text"], s["workload"],
                    s["model"]) + "\n" + per_tp(table)
    (args.out / "what_if.md").write_text(text)
    print(text)
    return table


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
