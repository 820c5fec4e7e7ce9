"""`python -m experiments.bench_throughput [overrides] [options]`: offline throughput against nano-vllm's benchmark.

nano-vllm's bench.py on our engine: 256 requests drawn with random.seed(0) (prompts of 100..1024
token ids in 0..10000, max_tokens 100..1024, temperature 0.6, ignore_eos), Qwen3-0.6B shapes with
dummy bf16 weights, CUDA graphs on; one warm-up generate, then output tokens / wall time.
In the same run:
- the bandwidth floor of this workload: every decode step reads the weights once and the KV of
  each running sequence; with all requests decoding together (fewest weight passes) that is
  `(max_out - 1) * weight_bytes + kv_bytes_per_token * sum_i sum_{j<out_i} (prompt_i + j)` bytes,
  over the device-to-device copy bandwidth measured here; we report our fraction of it;
- the compute-aware floor: each step floored at max(bytes / copy bandwidth, FLOPs / matmul peak
  measured here), the decode steps as above (every running sequence's GEMMs and attention) plus
  the prefills (all prompt tokens' GEMMs and causal attention, one LM-head row per prompt): a run
  whose prefills are seconds of matmul (an 8B model) reads against what it could reach;
- the peers on the same requests (a subset for the slow ones, reported on that subset):
  transformers continuous batching and padded `generate`;
- a latency run: Poisson arrivals at three rates through `experiments.run backend=engine`
  (nano-vllm's length distribution), TTFT and TPOT p50/p99.
Prints one table and writes CSV + markdown (device, date, versions) to --out (default outputs/bench_throughput/).
Overrides are Hydra overrides of conf/config.yaml (e.g. `model.num_hidden_layers=2` for a smoke run).
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from experiments.lib import factory
from experiments.lib.engine_backend import engine_args, get_engine, release_engine
from experiments.lib.engine_bench import BASE, copy_bandwidth, device_sync, markdown_table
from experiments.lib.fidelity_spec import compose_cfg
from experiments.lib.hf_peers import PeerResult, continuous_batching, hf_model, padded_generate
from experiments.lib.run_workload import run
from policies.request import SamplingParams

RESULTS = Path("outputs/bench_throughput")


def floor_bytes(prompt_lens: list[int], output_lens: list[int], weight_bytes: int,
                kv_bytes_per_token: int) -> int:
    decode_steps = max(output_lens) - 1  # the first token of each request comes from its prefill
    kv_tokens = sum((out - 1) * p + (out - 1) * out // 2 for p, out in zip(prompt_lens, output_lens))
    return decode_steps * weight_bytes + kv_tokens * kv_bytes_per_token


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 8192, iters: int = 10) -> float:
    """FLOP/s of a square matrix product in `dtype` (8192^3 on a GPU, 1024^3 on the CPU)."""
    size = size if device.type == "cuda" else 1024
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    device_sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    device_sync(device)
    seconds = time.perf_counter() - start
    del a, b
    return 2 * size**3 * iters / seconds


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Per-step bytes and FLOPs of one GPU's share of the model."""

    weight_bytes: int  # read once per step (every parameter but an untied input embedding)
    kv_bytes_per_token: int
    lm_head_params: int
    linear_params: int  # every other matmul parameter a token runs through (decoder layers)
    attention_flops_per_pair: int  # 4 L H D: QK^T and PV of one (query, key) pair over all layers


def compute_aware_floor_s(prompt_lens: list[int], output_lens: list[int], costs: StepCosts,
                          bandwidth: float, flops: float) -> float:
    """Seconds: every decode step (all requests decoding together, as `floor_bytes`) at
    max(its bytes / bandwidth, its FLOPs / flops), plus the prefills at max(one weight pass and
    the prompts' KV written / bandwidth, their FLOPs / flops) -- a lower bound whichever way the
    engine chunks them."""
    c = costs
    prompt_tokens = sum(prompt_lens)
    prefill_flops = (2 * prompt_tokens * c.linear_params + 2 * len(prompt_lens) * c.lm_head_params
                     + c.attention_flops_per_pair * sum(p * (p + 1) // 2 for p in prompt_lens))
    total = max((c.weight_bytes + prompt_tokens * c.kv_bytes_per_token) / bandwidth, prefill_flops / flops)
    for j in range(1, max(output_lens)):  # decode step j: the requests with more than j tokens
        running = [p for p, out in zip(prompt_lens, output_lens) if out > j]
        context = sum(running) + j * len(running)
        step_bytes = c.weight_bytes + context * c.kv_bytes_per_token
        step_flops = 2 * len(running) * (c.linear_params + c.lm_head_params) + c.attention_flops_per_pair * context
        total += max(step_bytes / bandwidth, step_flops / flops)
    return total


def weight_bytes_per_step(model: torch.nn.Module, tied: bool) -> int:
    """Every parameter is read once per step, except an untied input embedding (rows gathered)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:
        emb = next(p for n, p in model.named_parameters() if "embed_tokens" in n)
        total -= emb.numel() * emb.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/config.yaml")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--cb-requests", type=int, default=48, help="requests for transformers' CB")
    ap.add_argument("--padded-requests", type=int, default=16, help="requests for padded generate")
    ap.add_argument("--padded-batch", type=int, default=16)
    ap.add_argument("--rates", default="0.3,0.6,0.9", help="latency-run arrival rates, x our req/s capacity")
    ap.add_argument("--latency-requests", type=int, default=150)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs of the benchmark on one engine; the median is reported")
    ap.add_argument("--skip-peers", action="store_true", help="do not run the transformers peers")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats} is invalid: at least 1")
    wl = [f"workload.num_requests={a.num_requests}", f"workload.max_input_len={a.max_input_len}",
          f"workload.max_output_len={a.max_output_len}"]
    cfg = compose_cfg([*BASE, *wl, *a.overrides])
    workload = factory.workload(cfg)
    prompts = [r.prompt_token_ids for r in workload.requests]
    params = [r.sampling_params for r in workload.requests]
    max_tokens = [p.max_tokens for p in params]
    args = engine_args(cfg)
    device = torch.device(args.resolve_device())
    bandwidth = copy_bandwidth(device)  # before the KV cache takes the memory
    peak = matmul_flops(device, getattr(torch, args.dtype or cfg.model.dtype))

    from engine.offline.llm import LLM  # the engine is shared with the latency runs below
    engine = get_engine(args)
    llm = LLM.from_engine(engine)
    model_cfg, dtype = engine.model_config, engine.runner.dtype
    warm = [p[:37 + 61 * i] for i, p in enumerate(prompts[:16])]  # varied shapes: kernels compile here
    llm.generate(warm, SamplingParams(temperature=0.6, max_tokens=24, ignore_eos=True), use_tqdm=False)
    runs = []
    for _ in range(a.repeats):
        engine.reset()
        device_sync(device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        device_sync(device)
        runs.append(time.perf_counter() - start)
    seconds = statistics.median(runs)
    num_output = sum(o.num_output_tokens for o in outputs)
    note = (f"block_size {args.block_size}, CUDA graphs {engine.runner.graphs is not None}, "
            f"tensor_parallel_size {args.tensor_parallel_size}")
    tp_group = getattr(engine.runner, "tp", None)
    if tp_group is not None:  # which all-reduce ran: symmetric memory for small messages, or NCCL only
        custom = tp_group.custom
        note += f", custom all-reduce {'off' if custom is None else 'on (' + custom.kernel + ' kernels)'}"
    if a.repeats > 1:
        note += "; median of " + " / ".join(f"{num_output / t:,.0f}" for t in runs) + " tok/s"
    ours = PeerResult("servelab LLM.generate", len(prompts), sum(max_tokens), num_output, seconds, note)
    # Per GPU: under tensor parallelism every rank reads its shard and its KV heads at once, so the
    # floor is rank 0's bytes over one GPU's bandwidth.
    floor = floor_bytes([len(p) for p in prompts], max_tokens,
                        weight_bytes_per_step(engine.runner.model, model_cfg.tie_word_embeddings),
                        engine.runner.local_config.kv_bytes_per_token_in(dtype.itemsize))
    floor_s = floor / bandwidth
    compute_floor_s = compute_aware_floor_s([len(p) for p in prompts], max_tokens,
                                            step_costs(engine, model_cfg, dtype), bandwidth, peak)
    floors = Floors(bandwidth, peak, floor, floor_s, compute_floor_s)
    print(f"ours: {ours.tok_s:,.0f} output tok/s ({ours.output_tokens} tokens in {seconds:.2f} s); floor "
          f"{ours.output_tokens / floor_s:,.0f} tok/s at {bandwidth / 1e12:.2f} TB/s (bytes only), "
          f"{ours.output_tokens / compute_floor_s:,.0f} tok/s with {peak / 1e12:.0f} TFLOP/s (compute-aware)",
          flush=True)
    capacity_req_s = len(prompts) / seconds
    rates = [float(x) * capacity_req_s for x in a.rates.split(",") if x.strip()]
    try:
        latency_rows = latency_runs(a.overrides, rates, a.latency_requests) if rates else []
    except Exception as e:  # noqa: BLE001 (report the rest of the benchmark anyway)
        print(f"latency runs failed: {type(e).__name__}: {e}", flush=True)
        latency_rows = [{"error": f"{type(e).__name__}: {e}"[:300]}]

    report(a, device, floors, ours, [], latency_rows)  # kept if the peers never end
    if a.skip_peers:
        return
    del llm, engine, outputs
    release_engine()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = hf_model(model_cfg, str(device), dtype)
    n_cb, n_pad = min(a.cb_requests, len(prompts)), min(a.padded_requests, len(prompts))
    peers = [_guarded("transformers generate_batch (continuous batching)", n_cb, max_tokens[:n_cb],
                      lambda: continuous_batching(hf, prompts[:n_cb], max_tokens[:n_cb], 0.6)),
             _guarded("transformers generate (padded)", n_pad, max_tokens[:n_pad], lambda: padded_generate(
                 hf, prompts[:n_pad], max_tokens[:n_pad], 0.6, a.padded_batch))]
    report(a, device, floors, ours, peers, latency_rows)


def _guarded(name: str, num_requests: int, max_tokens: list[int], fn) -> PeerResult:
    """A peer that fails is reported as failed (with the error) instead of losing the whole run."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (any failure of a third-party peer is reported, not raised)
        print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
        note = f"failed: {type(e).__name__}: {e}"[:200]
        return PeerResult(name, num_requests, sum(max_tokens), 0, float("nan"), note)


def latency_runs(user_overrides: list[str], rates: list[float], num_requests: int) -> list[dict]:
    """Poisson arrivals through `experiments.run backend=engine` (the engine of the throughput run is
    reused); traces go to outputs/bench_throughput/."""
    rows = []
    stamp = dt.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    base = [o for o in BASE if not o.startswith("workload")]
    lengths = ["workload.prompt_len.low=100", "workload.prompt_len.high=1024", "workload.output_len.low=100",
               "workload.output_len.high=1024"]
    for rate in rates:
        cfg = compose_cfg([*base, "workload=poisson", f"workload.num_requests={num_requests}",
                           f"workload.rate={rate:.4g}", *lengths,
                           *[o for o in user_overrides if not o.startswith("workload")]])
        out_dir = Path("outputs/bench_throughput") / stamp / f"rate_{rate:.4g}"
        s = run(cfg, out_dir, f"poisson {rate:.3g} req/s")
        rows.append({"rate_req_s": rate, "requests": s["completed"], "output_tok_s": s["output_throughput"],
                     "ttft_p50_ms": 1e3 * s["ttft"]["median"], "ttft_p99_ms": 1e3 * s["ttft"]["p99"],
                     "tpot_p50_ms": 1e3 * s["tpot"]["median"], "tpot_p99_ms": 1e3 * s["tpot"]["p99"]})
    return rows


@dataclass(frozen=True, slots=True)
class Floors:
    bandwidth: float  # B/s, device copy
    matmul_flops: float  # FLOP/s, measured matmul
    floor_bytes: int
    floor_s: float  # bytes only
    compute_floor_s: float  # each step at max(bytes, FLOPs)


def step_costs(engine, model_cfg, dtype: torch.dtype) -> StepCosts:
    """Rank 0's share of the model (under tensor parallelism every rank runs its shard at once)."""
    local, model = engine.runner.local_config, engine.runner.model
    weight_bytes = weight_bytes_per_step(model, model_cfg.tie_word_embeddings)
    head = model.lm_head_weight.numel()
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n
                 and "lm_head" not in n)
    return StepCosts(weight_bytes, local.kv_bytes_per_token_in(dtype.itemsize), head, matmul,
                     4 * local.num_hidden_layers * local.num_attention_heads * local.head_dim)


def report(a, device: torch.device, floors: Floors, ours: PeerResult,
           peers: list[PeerResult], latency_rows: list[dict]) -> None:
    import transformers
    import triton

    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else platform.processor() or "cpu")
    now = dt.datetime.now(dt.UTC)
    env = {"device": device_name, "date": now.strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
           "cuda": torch.version.cuda, "triton": triton.__version__, "transformers": transformers.__version__,
           "command": "python -m experiments.bench_throughput " + " ".join(sys.argv[1:])}
    bandwidth, floor, floor_s = floors.bandwidth, floors.floor_bytes, floors.floor_s
    floor_tok_s = ours.output_tokens / floor_s
    compute_tok_s = ours.output_tokens / floors.compute_floor_s
    rows = []
    for r in [ours, *peers]:
        rows.append({"system": r.name, "requests": r.num_requests, "output_tokens": r.output_tokens,
                     "computed_tokens": r.computed_tokens, "seconds": round(r.seconds, 3),
                     "output_tok_s": round(r.tok_s, 1), "ours_x": round(ours.tok_s / r.tok_s, 2),
                     "note": r.note})
    table = pd.DataFrame(rows)
    floor_line = (f"bandwidth floor: {floor / 1e12:.2f} TB read at {bandwidth / 1e12:.2f} TB/s "
                  f"(device copy, measured) = "
                  f"{floor_s:.2f} s -> {floor_tok_s:,.0f} output tok/s; ours = {ours.tok_s:,.0f} tok/s = "
                  f"{100 * ours.tok_s / floor_tok_s:.1f}% of the floor\n"
                  f"compute-aware floor: each step at max(bytes / {bandwidth / 1e12:.2f} TB/s, FLOPs / "
                  f"{floors.matmul_flops / 1e12:.0f} TFLOP/s matmul, measured) = {floors.compute_floor_s:.2f} s -> "
                  f"{compute_tok_s:,.0f} output tok/s; ours = {100 * ours.tok_s / compute_tok_s:.1f}% of it")
    lat = pd.DataFrame(latency_rows).round(2)
    print(" | ".join(f"{k}: {v}" for k, v in env.items()))
    print(table.to_string(index=False))
    print(floor_line)
    if latency_rows:
        print(lat.to_string(index=False))
    a.out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    stem = a.out / f"bench_throughput_{slug}_{now.strftime('%Y-%m-%d')}"
    meta = {**env, "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "floor_s": round(floor_s, 3),
            "floor_tok_s": round(floor_tok_s, 1), "fraction_of_floor": round(ours.tok_s / floor_tok_s, 4),
            "matmul_tflops": round(floors.matmul_flops / 1e12, 1),
            "compute_floor_s": round(floors.compute_floor_s, 3), "compute_floor_tok_s": round(compute_tok_s, 1),
            "fraction_of_compute_floor": round(ours.tok_s / compute_tok_s, 4)}
    sections = [table.assign(section="throughput"), lat.assign(section="latency"),
                pd.DataFrame([meta]).assign(section="meta")]
    pd.concat(sections, ignore_index=True).to_csv(f"{stem}.csv", index=False)
    md = "\n".join([f"# Throughput benchmark ({device_name})", "",
                    *[f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in env.items()], "",
                    markdown_table(table), "", floor_line, ""])
    if latency_rows:
        md += "\n".join(["", "Latency (Poisson arrivals through backend=engine):", "", markdown_table(lat), ""])
    Path(f"{stem}.md").write_text(md)
    print(f"wrote {stem}.csv and {stem}.md")


if __name__ == "__main__":
    main()
