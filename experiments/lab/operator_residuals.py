"""Where the operator model misses an engine run's decode steps: each decode-only step of a saved
engine run (`experiments.fidelity --engine-only --runs R`) priced by `latency=operators` at its
batch, summed and longest context, and the engine's step time minus the price, by batch size.

    python -m experiments.lab.operator_residuals --runs R/offline/engine model=qwen3-8b [parallel.tensor_parallel_size=2]

The contexts come from the run's requests: a request's k-th token after its first was emitted by
the step whose record time it carries, which read prompt + k KV entries (c + 1 of
sim/latency/base.py). Prints per batch-size bin: steps, mean engine and model step, the model's
decode attention, the residual (engine - model), the steps that were host hiccups
(experiments/lib/host_hiccups.py), the residual of the others and the relative error.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

BINS = (0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256)


def step_contexts(step_times: np.ndarray, prompts: list[int], token_times: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """(summed, longest) KV entries the decodes of each step read: a request's k-th token after its
    first (k >= 1), emitted by the first step recorded at or after its time, read prompt + k."""
    total, longest = np.zeros(len(step_times)), np.zeros(len(step_times))
    for prompt, times in zip(prompts, token_times, strict=True):
        steps = np.minimum(np.searchsorted(step_times, np.asarray(times[1:]) - 1e-7), len(step_times) - 1)
        contexts = prompt + np.arange(1, len(steps) + 1)
        np.add.at(total, steps, contexts)
        np.maximum.at(longest, steps, contexts)
    return total, longest


def residuals(run_dir: Path, overrides: list[str]) -> pd.DataFrame:
    from experiments.lib.factory import build_latency
    from experiments.lib.fidelity_spec import compose_cfg
    from experiments.lib.host_hiccups import decode_only, hiccup_excess
    from sim.latency.base import BatchShape
    from sim.latency.token_padding import padded

    steps = pd.read_parquet(run_dir / "steps.parquet")
    requests = pd.read_parquet(run_dir / "requests.parquet")
    _, longest = step_contexts(steps.time.to_numpy(), list(requests.prompt_len), list(requests.token_times))
    model = build_latency(compose_cfg(["backend=sim", "latency=operators", "scheduler.async_scheduling=true",
                                       *overrides]))
    decodes = steps.assign(longest=longest)
    decodes = decodes[decode_only(decodes)].assign(hiccup_s=hiccup_excess(steps))
    layers = model.model.num_hidden_layers
    priced, attention = [], []
    for n, kv, top in zip(decodes.num_decode_seqs, decodes.kv_tokens, decodes.longest, strict=True):
        shape = BatchShape(num_decode_seqs=int(n), num_context_tokens=int(kv), num_samples=int(n),
                           max_context_tokens=int(max(top, kv / n)))
        priced.append(model.shape_time(shape))
        attention.append(layers * model.decode_attention(shape, padded(int(n), model.batch_sizes)))
    return decodes.assign(model_s=priced, attention_s=attention)


def by_batch(table: pd.DataFrame) -> pd.DataFrame:
    """Per batch-size bin of a `residuals` table (its `hiccup_s`: `hiccup_excess` of each step)."""
    table = table.assign(residual_s=table.duration - table.model_s, hiccup=table.hiccup_s > 0,
                         calm_residual_s=(table.duration - table.model_s).where(table.hiccup_s == 0),
                         batch=pd.cut(table.num_decode_seqs, list(BINS)))
    g = table.groupby("batch", observed=True).agg(steps=("duration", "size"), engine_ms=("duration", "mean"),
                                                  model_ms=("model_s", "mean"), attention_ms=("attention_s", "mean"),
                                                  residual_us=("residual_s", "mean"), hiccups=("hiccup", "sum"),
                                                  calm_residual_us=("calm_residual_s", "mean"))
    g["error_pct"] = (g.model_ms / g.engine_ms - 1) * 100
    g[["engine_ms", "model_ms", "attention_ms"]] *= 1e3
    g[["residual_us", "calm_residual_us"]] *= 1e6
    return g.round(3)


def totals(table: pd.DataFrame) -> str:
    """All decode steps of a `residuals` table: the model's error, the host hiccups' share, and the
    model's error on the other steps."""
    calm = table[table.hiccup_s == 0]
    error = (table.model_s.sum() / table.duration.sum() - 1) * 100
    calm_error = (calm.model_s.sum() / calm.duration.sum() - 1) * 100
    return (f"decode steps: {len(table)}, engine {table.duration.sum():.3f} s, model {error:+.1f}%; host hiccups "
            f"{len(table) - len(calm)} steps, {table.hiccup_s.sum() * 1e3:.0f} ms; the other steps: model {calm_error:+.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="one scenario's engine run: a folder with steps/requests.parquet")
    parser.add_argument("overrides", nargs="*", help="config overrides (model=..., parallel.tensor_parallel_size=...)")
    args = parser.parse_args()
    run_dir = Path(args.runs)
    for name in ("steps.parquet", "requests.parquet"):
        if not (run_dir / name).is_file():
            raise SystemExit(f"--runs={args.runs!r} is invalid: no {name} there (an engine run's folder, "
                             "e.g. R/offline/engine)")
    table = residuals(run_dir, args.overrides)
    print(by_batch(table).to_string())
    print(totals(table))


if __name__ == "__main__":
    main()
