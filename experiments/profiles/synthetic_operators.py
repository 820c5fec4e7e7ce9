"""`python -m experiments.profiles.synthetic_operators [hardware=h200] [--out DIR]`: write an operator
profile computed from the roofline model's formulas (not measured!), so that `latency=operators`
runs without a GPU and tests can check it against `latency=roofline`:

    python -m experiments.profiles.synthetic_operators --out /tmp/ops
    python -m experiments.run latency=operators latency.dir=/tmp/ops latency.gpu=h200-roofline

Each operator costs what sim/latency/roofline.py charges for it: max(bytes / bandwidth, FLOPs /
rate) for GEMMs and attention, bytes / bandwidth for the elementwise ops (4 h per RMSNorm and
5 I per SiLU-and-mul, so a layer's two norms and its activation make the roofline's 8 h + 5 I
elements per token), `step_overhead_s` per graph launch, ring formulas for the collectives
(sim/latency/tensor_parallel.py), and next to nothing for what the roofline does not price
(embedding, q/k RoPE + KV write, sampler). The grid is dense (steps of 2^(1/8) in tokens) because
log-space interpolation rounds the roofline's max() kinks.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.lib import factory
from experiments.lib.fidelity_spec import compose_cfg
from sim.latency.operator_file import write_operator_file
from sim.latency.shapes import Hardware
from sim.latency.tensor_parallel import RingLink

TINY_S = 1e-12  # per element: what the roofline does not price


def _powers(low: int, high: int, steps_per_octave: int) -> list[int]:
    points, i = set(), 0
    while (x := round(low * 2 ** (i / steps_per_octave))) <= high:
        points.add(x)
        i += 1
    return sorted(points)


GRID = {"m": _powers(1, 32768, 8), "k": _powers(64, 65536, 1), "n": _powers(64, 524288, 1),
        "head_dim": [64, 128], "kv_heads": [1, 2, 4, 8], "groups": [1, 2, 4, 8],
        "decode_seqs": _powers(1, 1024, 1), "decode_context": _powers(16, 131072, 1),
        "prefill_tokens": _powers(1, 32768, 2), "prefill_context": [0, *_powers(16, 131072, 1)],
        "widths": _powers(64, 131072, 1), "vocab": _powers(1024, 524288, 1),
        "bytes": _powers(1024, 2**34, 4), "world_sizes": [2, 4, 8]}


def roofline_rows(hw: Hardware, dtype_bytes: int = 2) -> list[dict]:
    bw = hw.hbm_bandwidth * hw.bandwidth_efficiency
    rate = hw.flops_for(dtype_bytes)
    gemm_rate, attn_rate, b = rate * hw.gemm_efficiency, rate * hw.attention_efficiency, dtype_bytes
    g = GRID
    rows = [{"op": "gemm", "m": m, "k": k, "n": n, "time_s": max(k * n * b / bw, 2 * m * k * n / gemm_rate)}
            for k in g["k"] for n in g["n"] for m in g["m"]]
    for d in g["head_dim"]:
        for kv in g["kv_heads"]:
            for grp in g["groups"]:
                heads = {"num_heads": kv * grp, "num_kv_heads": kv, "head_dim": d}
                kv_bytes, pair_flops = 2 * kv * d * b, 4 * kv * grp * d
                rows += [{"op": "decode_attention", "m": bs, "context": c, **heads,
                          "time_s": max(bs * c * kv_bytes / bw, bs * c * pair_flops / attn_rate)}
                         for bs in g["decode_seqs"] for c in g["decode_context"]]
                rows += [{"op": "prefill_attention", "m": q, "context": c, **heads,
                          "time_s": max((c + q) * kv_bytes / bw, (q * c + q * (q + 1) / 2) * pair_flops / attn_rate)}
                         for q in g["prefill_tokens"] for c in g["prefill_context"]]
                rows += [{"op": "qk_rope_write", "m": m, **heads, "time_s": TINY_S * m} for m in g["m"]]
    for n in g["widths"]:
        for m in g["m"]:
            rows += [{"op": "add_rms_norm", "m": m, "n": n, "time_s": 4 * m * n * b / bw},
                     {"op": "rms_norm", "m": m, "n": n, "time_s": 4 * m * n * b / bw},
                     {"op": "silu_and_mul", "m": m, "n": n, "time_s": 5 * m * n * b / bw},
                     {"op": "embedding", "m": m, "n": n, "time_s": TINY_S * m * n}]
    rows += [{"op": "sampler", "m": m, "n": n, "time_s": TINY_S * m * n} for n in g["vocab"] for m in g["m"]]
    for nbytes in g["bytes"]:
        rows += [{"op": "copy_blocks", "bytes": nbytes, "time_s": 2 * nbytes / bw},
                 {"op": "swap_out", "bytes": nbytes, "time_s": hw.swap_latency_s + nbytes / hw.host_link_bandwidth},
                 {"op": "swap_in", "bytes": nbytes, "time_s": hw.swap_latency_s + nbytes / hw.host_link_bandwidth}]
    rows += [{"op": "graph_launch", "m": m, "time_s": hw.step_overhead_s} for m in (1, 2)]
    if hw.interconnect_bandwidth is not None and hw.interconnect_latency_s is not None:
        for n in g["world_sizes"]:
            link = RingLink.of(hw, n)
            for nbytes in g["bytes"]:
                rows += [{"op": "all_reduce", "bytes": nbytes, "world_size": n, "time_s": link.all_reduce_s(nbytes)},
                         {"op": "all_gather", "bytes": nbytes, "world_size": n, "time_s": link.all_gather_s(nbytes)}]
    return rows


def synthetic_operator_profile(hw: Hardware, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Write `<out_dir>/<hardware>-roofline-<dtype>-roofline.csv` (gpu `<hardware>-roofline`)."""
    meta = {"gpu": f"{hw.name}-roofline", "device": f"synthetic (roofline formulas of {hw.name})", "dtype": dtype,
            "kernels": "roofline", "versions": "none (computed)", "date": "computed",
            "command": "python -m experiments.profiles.synthetic_operators",
            "grid": json.dumps(GRID, separators=(",", ":"))}
    path = out_dir / f"{hw.name}-roofline-{dtype}-roofline.csv"
    return write_operator_file(path, meta, roofline_rows(hw, 4 if dtype == "float32" else 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", type=Path, required=True, help="directory for the file")
    args = parser.parse_args()
    cfg = compose_cfg(args.overrides)
    print(f"wrote {synthetic_operator_profile(factory.hardware(cfg), args.out, cfg.model.dtype)}")


if __name__ == "__main__":
    main()
