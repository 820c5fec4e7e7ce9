"""`python -m experiments.bench_kv_transfer`: how fast a request's KV blocks move from a prefill
engine process to a decode engine process (engine/disagg/kv_transfer.py), against the link's copy
bandwidth.

Two processes on two GPUs of one host (cuda:0 sends, cuda:1 receives; NCCL), or on the CPU with
gloo (`--device cpu`: a smoke test, its figures are the loopback's). For each request size (prompt
tokens -> blocks -> bytes for the model's shape: layers x 2 x block_size x KV heads x head_dim x
dtype bytes per block), the median of `--iters` transfers of blocks scattered over the cache:

- staged: the engine's way, every layer's K and V of the blocks gathered into one buffer, one
  message, scattered into the receiver's blocks: latency from the send's start (gather included)
  to the end of the receiver's scatter (both clocks are the host's monotonic clock);
- per-layer: one message per layer's K and per layer's V (2 x layers messages), each gathered by
  itself and scattered by itself;
- copy: one device-to-device copy of the same bytes from cuda:0 to cuda:1 in one process (a peer
  copy over NVLink where the GPUs have peer access: the link's physical limit), timed with CUDA
  events; on the CPU a memory copy.

GB/s are bytes / latency (10^9 bytes). The whole run is bounded by `--budget-s`; sizes left when it
runs out are reported as skipped. Prints a table and, with `--out`, writes it as JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import time
from pathlib import Path

import torch

from engine.disagg.kv_transfer import RECV_RANK, SEND_RANK, KVLink, join_store, open_store
from engine.model_loader import load_model_config

DEFAULT_TOKENS = "16,128,512,2048,8192,32768"
LINK_TIMEOUT_S = 30.0


def _caches(cfg, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    k = [torch.randn(shape, device=device).to(dtype) for _ in range(cfg.num_hidden_layers)]
    v = [torch.randn(shape, device=device).to(dtype) for _ in range(cfg.num_hidden_layers)]
    return k, v


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _blocks(num: int, total: int, seed: int) -> list[int]:
    """`num` distinct block ids spread over a cache of `total` (as a paged pool hands them out)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=g)[:num].tolist()


def _per_layer_send(link: KVLink, k, v, index) -> None:
    works = []
    for cache in (*k, *v):
        works.append(link.backend.send([cache.index_select(0, index)], RECV_RANK, 0))
    for w in works:
        w.wait()


def _per_layer_recv(link: KVLink, k, v, index) -> None:
    bufs = [torch.empty((len(index), *c.shape[1:]), dtype=c.dtype, device=c.device) for c in (*k, *v)]
    works = [link.backend.recv([b], SEND_RANK, 0) for b in bufs]
    for w, b, c in zip(works, bufs, (*k, *v)):
        w.wait()
        c.index_copy_(0, index, b)


def _receiver(port: int, conn, model: str, block_size: int, device: str, num_blocks: int) -> None:
    """cuda:1 (or the CPU): for each request from the sender, post the receive first, say ready,
    then receive and scatter, and report when the scatter is done."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cfg = load_model_config(model)
    dtype = cfg.torch_dtype if dev.type == "cuda" else torch.float32
    k, v = _caches(cfg, num_blocks, block_size, dev, dtype)
    link = KVLink(RECV_RANK, join_store(port, LINK_TIMEOUT_S), dev, LINK_TIMEOUT_S)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        layout, blocks = msg
        if layout == "staged":
            transfer = link.recv("bench", k, blocks)
            conn.send("ready")
            done = link.wait_all(LINK_TIMEOUT_S)
            if not done or done[0].error is not None:
                conn.send(("error", str(done[0].error if done else "timed out")))
                break
            link.scatter(transfer, k, v)
        else:
            index = torch.tensor(blocks, device=dev)
            conn.send("ready")
            _per_layer_recv(link, k, v, index)
        _sync(dev)
        conn.send(("done", time.monotonic()))
    link.close()


def _copy_seconds(nbytes: int, src_dev: torch.device, dst_dev: torch.device, iters: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        if src_dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="conf/model name, HF dir or .gguf (its KV shape)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma-separated request sizes in tokens")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop measuring after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = ap.parse_args()
    started = time.monotonic()
    sizes = sorted({int(t) for t in args.tokens.split(",") if t.strip()})
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"error: --tokens={args.tokens!r} is invalid: positive integers, comma-separated")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("error: --device cuda needs two GPUs (cuda:0 sends, cuda:1 receives); --device cpu: gloo")
    send_dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    recv_dev = torch.device("cuda", 1) if args.device == "cuda" else torch.device("cpu")
    cfg = load_model_config(args.model)
    dtype = cfg.torch_dtype if args.device == "cuda" else torch.float32
    block_bytes = args.block_size * cfg.kv_bytes_per_token_in(dtype.itemsize)
    num_blocks = 2 * math.ceil(sizes[-1] / args.block_size)  # the largest request fills half the cache
    if args.device == "cuda":
        torch.cuda.set_device(send_dev)
    k, v = _caches(cfg, num_blocks, args.block_size, send_dev, dtype)
    store = open_store(LINK_TIMEOUT_S)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_receiver, daemon=True,
                       args=(store.port, theirs, args.model, args.block_size, str(recv_dev), num_blocks))
    proc.start()
    link = KVLink(SEND_RANK, store, send_dev, LINK_TIMEOUT_S)
    rows = []
    try:
        for tokens in sizes:
            n = math.ceil(tokens / args.block_size)
            row = {"tokens": tokens, "blocks": n, "bytes": n * block_bytes}
            for layout in ("staged", "per-layer"):
                lat = []
                for i in range(args.iters + 2):  # two warm-up transfers
                    if time.monotonic() - started > args.budget_s:
                        break
                    blocks, theirs_blocks = _blocks(n, num_blocks, i), _blocks(n, num_blocks, 1000 + i)
                    ours.send((layout, theirs_blocks))
                    if not ours.poll(LINK_TIMEOUT_S) or ours.recv() != "ready":
                        raise SystemExit("error: the receiver did not answer")
                    t0 = time.monotonic()
                    if layout == "staged":
                        link.send("bench", k, v, blocks)
                        link.wait_all(LINK_TIMEOUT_S)
                    else:
                        _per_layer_send(link, k, v, torch.tensor(blocks, device=send_dev))
                    if not ours.poll(LINK_TIMEOUT_S):
                        raise SystemExit("error: the receiver did not finish a transfer")
                    status, value = ours.recv()
                    if status != "done":
                        raise SystemExit(f"error: the transfer failed: {value}")
                    if i >= 2:
                        lat.append(value - t0)
                row[f"{layout}_ms"] = statistics.median(lat) * 1e3 if lat else None
                row[f"{layout}_gbps"] = row["bytes"] / statistics.median(lat) / 1e9 if lat else None
            copy_s = _copy_seconds(row["bytes"], send_dev, recv_dev, args.iters)
            row["copy_ms"], row["copy_gbps"] = copy_s * 1e3, row["bytes"] / copy_s / 1e9
            rows.append(row)
            if time.monotonic() - started > args.budget_s:
                break
    finally:
        ours.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        link.close()
    _print(rows, sizes, args, cfg, block_bytes, send_dev)
    if args.out is not None:
        args.out.write_text(json.dumps({"model": args.model, "device": _device_name(send_dev),
                                        "block_bytes": block_bytes, "rows": rows}, indent=1))


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (gloo)"


def _print(rows, sizes, args, cfg, block_bytes, dev) -> None:
    def f(x, spec):
        return format(x, spec) if x is not None else "-"

    print(f"{args.model}: {cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads x {cfg.head_dim}, "
          f"block {args.block_size} tokens = {block_bytes / 2**10:.0f} KiB; {_device_name(dev)}, torch {torch.__version__}")
    print(f"{'tokens':>7} {'MiB':>8} {'staged ms':>10} {'GB/s':>7} {'per-layer ms':>13} {'GB/s':>7} "
          f"{'copy ms':>8} {'GB/s':>7} {'staged/copy':>11}")
    for r in rows:
        ratio = r["staged_gbps"] / r["copy_gbps"] if r["staged_gbps"] else None
        print(f"{r['tokens']:>7} {r['bytes'] / 2**20:>8.2f} {f(r['staged_ms'], '.3f'):>10} {f(r['staged_gbps'], '.1f'):>7} "
              f"{f(r['per-layer_ms'], '.3f'):>13} {f(r['per-layer_gbps'], '.1f'):>7} {r['copy_ms']:>8.3f} "
              f"{r['copy_gbps']:>7.1f} {f(ratio, '.2f'):>11}")
    skipped = [t for t in sizes if t not in {r["tokens"] for r in rows}]
    if skipped:
        print(f"skipped (--budget-s={args.budget_s} spent): {skipped}")


if __name__ == "__main__":
    main()
