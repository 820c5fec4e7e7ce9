"""Showcase sections for the scheduling policies from the literature (experiments.showcase runs them):

4. Length-aware scheduling under heavy-tailed output lengths: fcfs, sjf and srpt on the oracle's and a
   learned predictor's lengths, and FastServe's skip-join mlfq, over a load sweep; then how much of
   sjf's gain a predictor's error gives back (a noisy oracle of growing error).
5. Fair share between a heavy and a light tenant: fcfs vs vtc over a sweep of the heavy tenant's
   rate, the light tenant's latency against its solo run, and the largest service gap.
Simulator (roofline model), same base config as the other sections.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HEAVY_TAIL = ["workload=sharegpt", "workload.num_requests=1500", "workload.max_tokens=4096",
              "workload.output_len={dist: lognormal, mean: 338, sigma: 1.5, min: 4, max: 4096}",
              "+workload.length_correlation=0.6", "blocks.kv_cache_gib=4"]
LENGTH_RATES = (45, 55, 65, 80)
LENGTH_POLICIES = (("fcfs", []), ("sjf oracle", ["policy=sjf", "policy.predictor=oracle"]),
                   ("sjf bucket", ["policy=sjf", "policy.predictor={kind: bucket}"]),
                   ("srpt oracle", ["policy=srpt", "policy.predictor=oracle"]),
                   ("srpt bucket", ["policy=srpt", "policy.predictor={kind: bucket}"]),
                   ("mlfq", ["policy=mlfq"]))
NOISE_RATE, NOISE_SIGMAS = 65, (0.0, 0.5, 1.0, 2.0)

TENANT_SECONDS, LIGHT_RATE, HEAVY_RATES = 20, 5, (90, 120, 150)
TENANTS = ["workload=tenants", "blocks.kv_cache_gib=4"]

Run = Callable[[Sequence[str], Path, str], dict[str, Any]]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}"


def length_aware(run: Run, out: Path) -> str:
    rows, fcfs = [], {}
    for rate in LENGTH_RATES:
        for label, overrides in LENGTH_POLICIES:
            s = run([*HEAVY_TAIL, f"workload.rate={rate}", *overrides], out / f"len-{label.replace(' ', '-')}-{rate}",
                    f"{label} @ {rate}")
            e2e = s["e2e"]
            if label == "fcfs":
                fcfs[rate] = e2e
            change = (f"{e2e['mean'] / fcfs[rate]['mean'] - 1:+.0%} / {e2e['p90'] / fcfs[rate]['p90'] - 1:+.0%}"
                      if label != "fcfs" else "")
            pred = s.get("output_len_predictor")
            err = f"{pred['mean_relative_error']:.2f} / {pred['spearman']:.2f}" if pred else ""
            rows.append(f"| {rate} | {label} | {_ms(e2e['mean'])} | {_ms(e2e['p90'])} | {change} | "
                        f"{_ms(s['ttft']['mean'])} | {s['request_throughput']:.1f} | {s['num_preemptions']} | {err} |")
    noise = []
    for sigma in NOISE_SIGMAS:
        s = run([*HEAVY_TAIL, f"workload.rate={NOISE_RATE}", "policy=sjf",
                 f"policy.predictor={{kind: noisy-oracle, sigma: {sigma}}}"], out / f"len-noise-{sigma}",
                f"sjf noisy-oracle sigma={sigma}")
        pred, e2e, base = s["output_len_predictor"], s["e2e"], fcfs[NOISE_RATE]
        noise.append(f"| {sigma} | {pred['mean_relative_error']:.2f} | {pred['spearman']:.2f} | {_ms(e2e['mean'])} "
                     f"({e2e['mean'] / base['mean'] - 1:+.0%}) | {_ms(e2e['p90'])} ({e2e['p90'] / base['p90'] - 1:+.0%}) |")
    return ("### 4. Length-aware scheduling under heavy-tailed output lengths\n\n"
            "ShareGPT-like prompts, output lengths lognormal with mean 338 and sigma 1.5 (a heavy tail up to "
            "4,096 tokens), log prompt and output lengths correlated 0.6, `max_tokens=4096` for every request "
            "(so the client's `max_tokens` tells nothing), 1,500 Poisson requests, 4 GiB of KV (capacity "
            "about 50 req/s). `oracle` orders by the true output length (the upper bound); `bucket` by the "
            "per-prompt-length-bucket mean learned from another seed's draw of the same workload. "
            "Change = mean / p90 e2e against fcfs at that rate; predictor error = mean relative error / "
            "Spearman rank correlation.\n\n"
            "| req/s | policy | e2e mean ms | e2e p90 ms | change vs fcfs | TTFT mean ms | req/s done | "
            "preemptions | predictor error |\n|---:|---|---:|---:|---|---:|---:|---:|---|\n" + "\n".join(rows)
            + f"\n\nWhat a predictor's error gives back: sjf at {NOISE_RATE} req/s on the true length times "
            "lognormal noise exp(sigma z) (fcfs for reference in the changes).\n\n"
            "| sigma | mean relative error | Spearman | e2e mean ms (vs fcfs) | e2e p90 ms (vs fcfs) |\n"
            "|---:|---:|---:|---:|---:|\n" + "\n".join(noise) + "\n")


def _tenant_overrides(heavy_rate: float | None) -> list[str]:
    light_n = LIGHT_RATE * TENANT_SECONDS
    if heavy_rate is None:
        return [*TENANTS, "workload.tenants.names=[light]", f"workload.tenants.rates=[{LIGHT_RATE}]",
                f"workload.tenants.num_requests=[{light_n}]"]
    return [*TENANTS, "workload.tenants.names=[heavy,light]", f"workload.tenants.rates=[{heavy_rate},{LIGHT_RATE}]",
            f"workload.tenants.num_requests=[{int(heavy_rate * TENANT_SECONDS)},{light_n}]"]


def fair_share(run: Run, out: Path) -> str:
    solo = run(_tenant_overrides(None), out / "tenants-solo", "light alone")["per_tenant"]["tenants"]["light"]
    rows = [(f"| - | light alone | {_ms(solo['e2e']['mean'])} | {_ms(solo['e2e']['p90'])} | "
             f"{_ms(solo['ttft']['mean'])} | - | - | - |")]
    for heavy in HEAVY_RATES:
        for policy in ("fcfs", "vtc"):
            s = run([*_tenant_overrides(heavy), f"policy={policy}"], out / f"tenants-{policy}-{heavy}",
                    f"{policy} heavy={heavy}")
            t = s["per_tenant"]["tenants"]
            light, share = t["light"], t["light"]["service"] / (t["light"]["service"] + t["heavy"]["service"])
            rows.append(f"| {heavy} | {policy} | {_ms(light['e2e']['mean'])} ({light['e2e']['mean'] / solo['e2e']['mean']:.1f}x) "
                        f"| {_ms(light['e2e']['p90'])} | {_ms(light['ttft']['mean'])} | {_ms(t['heavy']['e2e']['mean'])} | "
                        f"{share:.1%} | {s['per_tenant']['service_gap_max']:,.0f} |")
    return ("### 5. Fair share between a heavy and a light tenant (VTC)\n\n"
            f"Two tenants, each its own Poisson stream over {TENANT_SECONDS} s with ShareGPT-like lengths: "
            f"light at {LIGHT_RATE} req/s, heavy at the rate in the first column (the server holds about 50 "
            "req/s with 4 GiB of KV). `light alone` is the light tenant's same requests with the heavy tenant "
            "absent (its solo latency). Service in weighted tokens (prompt 1, output 2); the service gap is "
            "the largest difference in service between the two tenants over an interval in which both were "
            "backlogged (docs/metrics.md, per-tenant metrics).\n\n"
            "| heavy req/s | policy | light e2e mean ms (x solo) | light e2e p90 ms | light TTFT mean ms | "
            "heavy e2e mean ms | light's share of service | max service gap |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")
