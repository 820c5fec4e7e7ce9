"""Roofline calibration (`python -m experiments.calibrate`, `experiments.profile calibrate=true`):
the efficiency factors and per-step overhead fitted to a measured latency profile by least squares,
written as a hardware config. The method is described in experiments/calibrate.py.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import replace
from pathlib import Path

import yaml

from experiments.lib.paths import REPO_ROOT, write_output
from sim.latency import BatchShape, Hardware, ModelShape, RooflineModel
from sim.latency.profile_io import read_profile

FITTED = ("bandwidth_efficiency", "gemm_efficiency", "attention_efficiency", "step_overhead_s",
          "swap_latency_s", "swap_block_overhead_s")


def profile_points(path: str | Path) -> tuple[dict[str, str], list[tuple[BatchShape, float]], list[tuple[int, float]]]:
    """Metadata, (shape, seconds) of the step rows (a prefill = one sequence, no prefix, sampling)
    and (blocks, seconds) of the swap rows."""
    meta, rows = read_profile(path)
    steps, swaps = [], []
    for _, row in rows:
        t = float(row["time_s"])
        if row["kind"] == "swap":
            swaps.append((int(row["num_blocks"]), t))
            continue
        p, d, c = (int(row[k]) for k in ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens"))
        if p == 0 and d == 0:
            continue  # the grid's corner row: no step is empty, the roofline prices it 0
        shape = BatchShape(num_prefill_tokens=p, num_prefill_seqs=1 if p else 0, prefill_context_tokens=0,
                           prefill_attention_pairs=p * (p + 1) // 2, num_decode_seqs=d, num_context_tokens=c,
                           num_samples=d + (1 if p else 0))
        steps.append((shape, t))
    return meta, steps, swaps


def relative_errors(model: RooflineModel, steps: list[tuple[BatchShape, float]]) -> list[float]:
    return [model.shape_time(s) / t - 1.0 for s, t in steps]


def _with_overhead(model: ModelShape, hw: Hardware, block_size: int,
                   steps: list[tuple[BatchShape, float]]) -> tuple[Hardware, float]:
    """Best step_overhead_s for hw's efficiencies (closed form, clipped at 0) and the loss."""
    base = RooflineModel(model, replace(hw, step_overhead_s=0.0), block_size)
    b = [base.shape_time(s) for s, _ in steps]
    t = [t for _, t in steps]
    num = sum((1.0 - bi / ti) / ti for bi, ti in zip(b, t))
    den = sum(1.0 / (ti * ti) for ti in t)
    overhead = max(num / den, 0.0)
    loss = sum(((bi + overhead) / ti - 1.0) ** 2 for bi, ti in zip(b, t))
    return replace(hw, step_overhead_s=overhead), loss


def fit_steps(model: ModelShape, hw: Hardware, block_size: int, steps: list[tuple[BatchShape, float]],
              rounds: int = 40) -> Hardware:
    names = ("bandwidth_efficiency", "gemm_efficiency", "attention_efficiency")
    best, loss = _with_overhead(model, hw, block_size, steps)
    factor = 2.0
    for _ in range(rounds):
        improved = False
        for name in names:
            for f in (factor, 1.0 / factor):
                value = min(max(getattr(best, name) * f, 1e-3), 1.0)
                cand, cand_loss = _with_overhead(model, replace(best, **{name: value}), block_size, steps)
                if cand_loss < loss - 1e-15:
                    best, loss, improved = cand, cand_loss, True
        if not improved:
            factor = math.sqrt(factor)
            if factor < 1.001:
                break
    return best


def fit_swaps(hw: Hardware, block_bytes: int, swaps: list[tuple[int, float]]) -> Hardware:
    if not swaps:
        return hw
    n = [float(x) for x, _ in swaps]
    t = [y for _, y in swaps]
    mn, mt = sum(n) / len(n), sum(t) / len(t)
    sxx = sum((x - mn) ** 2 for x in n)
    slope = sum((x - mn) * (y - mt) for x, y in zip(n, t)) / sxx if sxx > 0 else mt / max(mn, 1.0)
    intercept = mt - slope * mn if sxx > 0 else 0.0
    per_block = max(slope - block_bytes / hw.host_link_bandwidth, 0.0)
    return replace(hw, swap_latency_s=max(intercept, 0.0), swap_block_overhead_s=per_block)


def _summary(errors: list[float]) -> str:
    a = sorted(abs(e) for e in errors)
    return f"mean |err| {sum(a) / len(a):.1%}, p90 {a[int(0.9 * (len(a) - 1))]:.1%}, max {a[-1]:.1%}"


def calibrate(profile: str | Path, hardware_yaml: str | Path) -> tuple[dict, str]:
    """(the calibrated hardware mapping, a report) for a profile and its base hardware config."""
    meta, steps, swaps = profile_points(profile)
    if not steps:
        raise ValueError(f"latency profile {str(profile)!r} has no step rows to calibrate on")
    base_cfg = yaml.safe_load(Path(hardware_yaml).read_text())
    base = Hardware.from_dict(base_cfg, where=f"hardware ({hardware_yaml})")
    model_yaml = REPO_ROOT / "conf" / "model" / f"{meta.get('model')}.yaml"
    if not model_yaml.is_file():
        raise ValueError(f"profile model={meta.get('model')!r} has no conf/model yaml to take its shape from")
    model = ModelShape.from_dict(yaml.safe_load(model_yaml.read_text()))
    block_size = int(meta.get("block_size", 16))
    fitted = fit_steps(model, base, block_size, steps)
    fitted = fit_swaps(fitted, model.kv_bytes_per_token * block_size, swaps)
    before = relative_errors(RooflineModel(model, base, block_size), steps)
    after = relative_errors(RooflineModel(model, fitted, block_size), steps)
    out = dict(base_cfg)
    out.update({k: float(f"{getattr(fitted, k):.4g}") for k in FITTED})
    report = (f"roofline calibration on {len(steps)} step rows of {profile}:\n"
              f"  base {Path(hardware_yaml).stem}: {_summary(before)}\n"
              f"  calibrated: {_summary(after)}\n  " +
              ", ".join(f"{k}={out[k]:.4g}" for k in FITTED))
    return out, report


def calibrate_to_file(profile: str | Path, hardware_yaml: str | Path, target: str | Path, command: str) -> str:
    """Fit, then write the hardware yaml to `target`; a target that cannot be written is a
    ValueError naming it (reading the profile or the hardware fails as itself)."""
    values, report = calibrate(profile, hardware_yaml)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    header = (f"# Roofline parameters fitted by least squares to {Path(profile).name} ({date}; {command}).\n"
              f"# Peaks are those of {Path(hardware_yaml).name}; efficiencies and overheads are fitted for\n"
              f"# that profile's model. Use: hardware={Path(target).stem} latency=roofline.\n"
              + "".join(f"# {line.strip()}\n" for line in report.splitlines()[1:3]))
    write_output(Path(target), header + yaml.safe_dump(values, sort_keys=False), "--out")
    return report + f"\n  -> {target}"
