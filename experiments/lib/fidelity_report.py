"""Sim-vs-engine comparison as pure functions over run traces (used by `experiments.fidelity` and
its tests).

`error_rows(engine, sim)`: for each headline metric the engine value (truth), the simulator's and
the relative error (sim - engine) / engine, with the fidelity targets: <= 5% on request and output
token throughput and mean TPOT, <= 10% on p90 TTFT (the others are reported without a target).
Metrics come from `experiments.lib.metrics.summarize` over each run's requests and steps, so both
sides use vLLM's definitions on the same trace schema.

`ranking_row(...)`: an A/B difference (B - A of one metric) measured on the engine and predicted
by the simulator: does the simulator get its sign, and how close is its size.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from experiments.lib.bootstrap import excludes_zero
from experiments.lib.host_hiccups import MIN_EXCESS_FRACTION, MIN_EXCESS_S, WINDOW
from experiments.lib.metrics import summarize

# (column, label, summary path, target or None)
METRICS = (
    ("request_throughput", "request throughput (req/s)", ("request_throughput",), 0.05),
    ("output_throughput", "output throughput (tok/s)", ("output_throughput",), 0.05),
    ("ttft_mean", "mean TTFT (s)", ("ttft", "mean"), None),
    ("ttft_p90", "p90 TTFT (s)", ("ttft", "p90"), 0.10),
    ("tpot_mean", "mean TPOT (s)", ("tpot", "mean"), 0.05),
    ("e2e_mean", "mean e2e (s)", ("e2e", "mean"), None),
    ("num_preemptions", "preemptions", ("num_preemptions",), None),
)
# A disaggregated run's KV hand-off (summary.json's `disaggregation`: handed-off requests that
# finished): the transfer time (prefill done -> KV on the decode side) within 10%, its parts shown.
TRANSFER_METRICS = (
    ("transfer_mean", "mean transfer (s)", ("disaggregation", "transfer_time", "mean"), 0.10),
    ("transfer_p90", "p90 transfer (s)", ("disaggregation", "transfer_time", "p90"), 0.10),
    ("decode_wait_mean", "mean decode wait (s)", ("disaggregation", "decode_wait", "mean"), None),
    ("link_wait_mean", "mean link wait (s)", ("disaggregation", "link_wait", "mean"), None),
    ("link_time_mean", "mean link time (s)", ("disaggregation", "link_time", "mean"), None),
    ("prefill_time_mean", "mean prefill (s)", ("disaggregation", "prefill_time", "mean"), None),
)
SECONDS = {"ttft_mean", "ttft_p90", "tpot_mean", "e2e_mean", *(m for m, *_ in TRANSFER_METRICS)}
SIZE_TOLERANCE = 0.25  # a predicted A/B difference "has the right size" within +-25% of the engine's


def metric_values(summary: Mapping[str, Any], metrics: Sequence[tuple] = METRICS) -> dict[str, float]:
    out = {}
    for col, _, path, _ in metrics:
        v: Any = summary
        for key in path:
            v = None if v is None else v.get(key)
        out[col] = math.nan if v is None else float(v)
    return out


def summary_of(requests: pd.DataFrame, steps: pd.DataFrame, block_size: int) -> dict[str, Any]:
    return summarize(requests, steps, block_size)


def relative_error(sim: float, engine: float) -> float:
    """(sim - engine) / |engine|; 0 when both are 0, nan when only the engine's is 0 or one is nan."""
    if math.isnan(sim) or math.isnan(engine):
        return math.nan
    if engine == 0:
        return 0.0 if sim == 0 else math.nan
    return (sim - engine) / abs(engine)


def error_rows(engine: Mapping[str, Any], sim: Mapping[str, Any], scenario: str,
               engine_repeats: Sequence[Mapping[str, Any]] | None = None,
               metrics: Sequence[tuple] = METRICS) -> list[dict[str, Any]]:
    """One row per metric (`METRICS`, or `TRANSFER_METRICS`): engine, sim, relative error, target,
    whether it is met. With `engine_repeats` (summaries of repeated engine runs of the same
    requests, two or more) the engine value is their mean and `engine_spread` their (max - min) /
    |mean|: the engine's own run-to-run noise, which no simulator error can be expected to beat."""
    s = metric_values(sim, metrics)
    repeats = [metric_values(r, metrics) for r in engine_repeats or ()]
    e = metric_values(engine, metrics) if len(repeats) < 2 else {
        col: float(np.mean([r[col] for r in repeats])) for col, *_ in metrics}
    rows = []
    for col, label, _, target in metrics:
        err = relative_error(s[col], e[col])
        ok = None if target is None or math.isnan(err) else abs(err) <= target
        spread = math.nan
        if len(repeats) >= 2:
            low, high = min(r[col] for r in repeats), max(r[col] for r in repeats)
            spread = 0.0 if low == high else (high - low) / abs(e[col]) if e[col] else math.nan
        rows.append({"scenario": scenario, "metric": col, "label": label, "engine": e[col], "sim": s[col],
                     "rel_error": err, "target": target, "within_target": ok, "engine_spread": spread})
    return rows


def error_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["scenario", "metric", "label", "engine", "sim", "rel_error", "target",
                                       "within_target", "engine_spread"])


def _num(v: float, metric: str) -> str:
    if math.isnan(v):
        return "-"
    if metric in SECONDS:
        return f"{v * 1e3:.1f} ms"
    if metric == "num_preemptions":
        return f"{v:.0f}"
    return f"{v:,.2f}"


def error_markdown(table: pd.DataFrame, metrics_of: Sequence[tuple] = METRICS) -> str:
    """Scenarios as rows; per metric `engine / sim (error)`; a mark where a target is missed."""
    metrics = [m for m, *_ in metrics_of]
    labels = {m: lab for m, lab, *_ in metrics_of}
    lines = ["| scenario | " + " | ".join(labels[m] for m in metrics) + " |",
             "|---|" + "---:|" * len(metrics)]
    for scenario, g in table.groupby("scenario", sort=False):
        cells = []
        for m in metrics:
            r = g[g["metric"] == m].iloc[0]
            err = "-" if math.isnan(r["rel_error"]) else f"{r['rel_error']:+.1%}"
            miss = " **!**" if r["within_target"] is False else ""
            spread = r.get("engine_spread", math.nan)
            noise = "" if spread is None or math.isnan(spread) else f" ±{spread / 2:.1%}"
            cells.append(f"{_num(r['engine'], m)}{noise} / {_num(r['sim'], m)} ({err}){miss}")
        lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
    targets = ", ".join(f"<= {target:.0%} on {label.split(' (')[0]}" for _, label, _, target in metrics_of
                        if target is not None)
    lines.append("")
    lines.append(f"Cells: engine / simulator (relative error of the simulator). Targets: {targets}; **!** marks a "
                 "missed target. With repeated engine runs the engine value is their mean, ± half their range.")
    return "\n".join(lines) + "\n"


def target_summary(table: pd.DataFrame) -> str:
    judged = table[table["within_target"].notna()]
    met = int(judged["within_target"].astype(bool).sum())
    worst = judged.loc[judged["rel_error"].abs().idxmax()] if len(judged) else None
    text = f"{met}/{len(judged)} targeted errors within target"
    if worst is not None:
        text += f"; largest {worst['rel_error']:+.1%} ({worst['scenario']}, {worst['metric']})"
    if "engine_spread" in judged and judged["engine_spread"].notna().any():
        noisy = judged["engine_spread"].fillna(0.0)
        within = int((judged["within_target"].astype(bool) | (judged["rel_error"].abs() <= noisy)).sum())
        text += (f"; {within}/{len(judged)} within target or within the engine's own run-to-run range "
                 f"(median range {judged['engine_spread'].median():.1%})")
    return text


def ranking_row(name: str, metric: str, engine_ab: Mapping[str, float], sim_ab: Mapping[str, float]) -> dict[str, Any]:
    """`engine_ab`/`sim_ab`: {a, b, diff, ci_low, ci_high} of one A/B metric (B - A) on each backend;
    a `significant` verdict in `engine_ab` (from `combine_rounds`, or a paired row's) overrides the
    interval test."""
    ed, sd = engine_ab["diff"], sim_ab["diff"]
    verdict = engine_ab.get("significant")  # None on a run-level row of one round: no interval to judge
    significant = excludes_zero(engine_ab) if verdict is None else bool(verdict)
    sign_ok = bool(np.sign(ed) == np.sign(sd))
    ratio = sd / ed if ed else math.nan
    return {"comparison": name, "metric": metric,
            "engine_a": engine_ab["a"], "engine_b": engine_ab["b"], "engine_diff": ed,
            "engine_rel": ed / engine_ab["a"] if engine_ab["a"] else math.nan, "engine_significant": significant,
            "sim_a": sim_ab["a"], "sim_b": sim_ab["b"], "sim_diff": sd,
            "sim_rel": sd / sim_ab["a"] if sim_ab["a"] else math.nan,
            "sign_predicted": sign_ok, "size_ratio": ratio,
            "size_predicted": bool(sign_ok and abs(ratio - 1) <= SIZE_TOLERANCE)}


def ranking_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| comparison | metric | engine A -> B (change) | sim A -> B (change) | sign | size (sim/engine) |",
             "|---|---|---:|---:|:---:|---:|"]
    for r in rows:
        latency = r["metric"].split()[0] in ("ttft", "tpot", "e2e", "queueing_time")
        f = (lambda x: f"{x * 1e3:.1f} ms") if latency else (lambda x: f"{x:,.3g}")
        sig = "" if r["engine_significant"] else " (n.s.)"
        lines.append(
            f"| {r['comparison']} | {r['metric']} | {f(r['engine_a'])} -> {f(r['engine_b'])} "
            f"({r['engine_rel']:+.1%}){sig} | {f(r['sim_a'])} -> {f(r['sim_b'])} ({r['sim_rel']:+.1%}) | "
            f"{'yes' if r['sign_predicted'] else 'NO'} | {r['size_ratio']:.2f} "
            f"{'(ok)' if r['size_predicted'] else '(off)'} |")
    lines.append("")
    lines.append(f"sign: the simulator's B - A has the engine's sign; size: simulator difference / engine "
                 f"difference, ok within +-{SIZE_TOLERANCE:.0%}; (n.s.): the engine's 95% paired-bootstrap "
                 "interval includes 0 or, with repeated engine runs (the mean of the rounds' differences is "
                 "shown), the rounds disagree in sign, one round's interval includes 0, or the difference is within "
                 "half the range of either arm's values over the rounds.")
    lines.append("")
    lines.append(ranking_summary(rows) + ".")
    return "\n".join(lines) + "\n"


def ranking_summary(rows: list[dict[str, Any]]) -> str:
    sig = [r for r in rows if r["engine_significant"]]
    count = lambda rs, key: sum(bool(r[key]) for r in rs)
    return (f"Sign predicted for {count(rows, 'sign_predicted')}/{len(rows)} differences and size for "
            f"{count(rows, 'size_predicted')}/{len(rows)}; of the {len(sig)} the engine shows significantly: "
            f"sign {count(sig, 'sign_predicted')}/{len(sig)}, size {count(sig, 'size_predicted')}/{len(sig)}")


def kv_usage(steps: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(step end times, fraction of GPU KV blocks in use) of a run."""
    t = (steps["time"] + steps["duration"]).to_numpy(dtype=float)
    total = steps["gpu_blocks_total"].replace(0, np.nan).to_numpy(dtype=float)
    return t, steps["gpu_blocks_used"].to_numpy(dtype=float) / total


STEP_KINDS = ("decode", "mixed", "swap")


def step_periods(steps: pd.DataFrame, clock: str) -> pd.DataFrame:
    """Each step's kind (decode-only, mixed = with prefill tokens, swap = moving blocks) and period:
    on the wall clock the time to the same replica's next step (the update and loop overhead
    included), in the simulator its duration. A fleet's trace interleaves its replicas' steps in
    time order (a `replica` column): each replica's steps are its own sequence."""
    kind = np.where((steps["num_swap_out_blocks"] > 0) | (steps["num_swap_in_blocks"] > 0), "swap",
                    np.where(steps["num_prefill_tokens"] > 0, "mixed", "decode"))
    if clock == "wall":
        start = steps.groupby("replica", sort=False)["time"] if "replica" in steps.columns else steps["time"]
        period = (start.shift(-1) - steps["time"]).fillna(steps["duration"])
    else:
        period = steps["duration"]
    busy = steps["num_batched_tokens"] > 0
    return pd.DataFrame({"kind": kind, "period": period.to_numpy(dtype=float)})[busy.to_numpy()]


def step_breakdown_rows(engine_steps: pd.DataFrame, sim_steps: pd.DataFrame, scenario: str) -> list[dict[str, Any]]:
    """Per step kind: count and mean period on the engine and in the simulator (where an error comes from)."""
    e, s = step_periods(engine_steps, "wall"), step_periods(sim_steps, "simulated")
    rows = []
    for kind in STEP_KINDS:
        ek, sk = e[e["kind"] == kind]["period"], s[s["kind"] == kind]["period"]
        if len(ek) or len(sk):
            em = float(ek.mean()) if len(ek) else math.nan
            sm = float(sk.mean()) if len(sk) else math.nan
            rows.append({"scenario": scenario, "kind": kind, "engine_steps": len(ek), "sim_steps": len(sk),
                         "engine_mean_s": em, "sim_mean_s": sm, "rel_error": relative_error(sm, em),
                         "engine_total_s": float(ek.sum()), "sim_total_s": float(sk.sum())})
    return rows


def breakdown_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| scenario | step kind | steps (engine / sim) | mean step (engine / sim) | error | total (engine / sim) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        err = "-" if math.isnan(r["rel_error"]) else f"{r['rel_error']:+.1%}"
        lines.append(f"| {r['scenario']} | {r['kind']} | {r['engine_steps']} / {r['sim_steps']} | "
                     f"{r['engine_mean_s'] * 1e3:.2f} / {r['sim_mean_s'] * 1e3:.2f} ms | {err} | "
                     f"{r['engine_total_s']:.2f} / {r['sim_total_s']:.2f} s |")
    lines.append("")
    lines.append("decode: decode-only steps (CUDA graphs of batch buckets); mixed: steps with prefill tokens (CUDA "
                 "graphs of token buckets); swap: steps that move KV blocks. Engine step = time to the replica's "
                 "next step (wall clock); totals add up every replica's steps.")
    return "\n".join(lines) + "\n"


def decode_step_ratio(steps: pd.DataFrame, price: Callable[[int, int], float]) -> float:
    """Median over a run's decode-only steps (no prefill, no swap) of its duration over
    `price(num_decode_seqs, kv_tokens)` (the profile's price of that shape): how fast this run's
    engine stepped against the profile (on the H200 VMs 0.92-1.06 per run: host speed drift)."""
    d = steps[(steps["num_prefill_tokens"] == 0) & (steps["num_decode_seqs"] > 0)
              & (steps["num_swap_out_blocks"] == 0) & (steps["num_swap_in_blocks"] == 0)]
    if d.empty:
        return math.nan
    prices = np.array([price(int(n), int(c)) for n, c in zip(d["num_decode_seqs"], d["kv_tokens"])])
    return float(np.median(d["duration"].to_numpy() / prices))


def report_markdown(meta: Mapping[str, Any], table: pd.DataFrame, ranking: list[dict[str, Any]],
                    breakdown: list[dict[str, Any]], settings: Mapping[str, Mapping[str, Any]], stall_s: float,
                    sections: str = "") -> str:
    """fidelity.md: run facts, the error table, the ranking table, the per-step-kind breakdown,
    `sections` (markdown: a disaggregated spec's transfer and goodput tables) and the scenarios'
    settings (with the host CPU gauge before each engine run, where recorded)."""
    lines = []
    for name, s in settings.items():
        line = f"- `{name}`: {' '.join(s.get('overrides', []))}"
        line += f" (rate {s['rate']} req/s)" if "rate" in s else ""
        line += f"; {s.get('num_requests')} requests, {s.get('num_gpu_blocks')} GPU blocks"
        if s.get("engine_stall_steps"):
            line += f"; engine stalls: {s['engine_stall_steps']} steps > {stall_s}s, {s['engine_stall_s']:.2f}s"
        if s.get("engine_hiccup_steps"):
            line += (f"; engine host hiccups: {s['engine_hiccup_steps']} decode steps, {s['engine_hiccup_s'] * 1e3:.0f} ms "
                     f"above their neighbours' median ({s['engine_hiccup_pct']:.1f}% of decode time)")
        if s.get("decode_vs_profile"):
            line += f"; decode steps / profile per engine run: {' / '.join(f'{x:.3f}' for x in s['decode_vs_profile'])}"
        if s.get("host_probe_us"):
            line += f"; host CPU gauge before each engine run: {' / '.join(f'{x:.0f}' for x in s['host_probe_us'])} us"
        lines.append(line)
    return (f"# Simulator fidelity: engine vs sim ({meta.get('latency_model', 'profiled')} latency)\n\n"
            f"- device: {meta['device']}\n- date: {meta['date']}\n- command: `{meta['command']}`\n"
            + (f"- engine runs: `{meta['engine_command']}`\n" if meta.get("engine_command") else "") +
            f"- profile: `{meta['profile']}`\n"
            + (f"- all-reduce: {meta['all_reduce']}\n" if meta.get("all_reduce") else "") +
            f"- versions: {meta['versions']}\n\n"
            f"## Errors\n\n{error_markdown(table)}\n{meta['targets']}.\n\n"
            f"## Policy ranking (A/B on the engine vs in the simulator)\n\n{ranking_markdown(ranking)}\n"
            f"## Where the time goes (per step kind)\n\n{breakdown_markdown(breakdown)}\n{sections}"
            f"## Scenarios\n\n" + "\n".join(lines) + "\n\nPlots: `<scenario>.png` (CDFs of TTFT, TPOT, E2E; KV "
            f"usage over time; `cpu_probe_us` in experiments/lib/profiling/host.py is the host CPU gauge; "
            f"host hiccups: decode steps above the median of the {WINDOW} around them by more than "
            f"{MIN_EXCESS_S * 1e3:g} ms and {MIN_EXCESS_FRACTION:.0%}, "
            f"experiments/lib/host_hiccups.py). "
            f"Traces: `{meta['runs_dir']}`.\n")
