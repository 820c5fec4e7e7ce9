"""`python -m experiments.bench_kv_transfer`: how fast a request's KV blocks move from a prefill
engine process to a decode engine process (engine/disagg/kv_transfer.py), against the link's copy
bandwidth.

Two processes on two GPUs of one host (cuda:0 sends, cuda:1 receives; NCCL), or on the CPU with
gloo (`--device cpu`: a smoke test, its figures are the loopback's). For each request size (prompt
tokens -> blocks -> bytes for the model's shape: layers x 2 x block_size x KV heads x head_dim x
dtype bytes per block), the median of `--iters` transfers of blocks scattered over the cache:

- staged: the engine's way, every layer's K and V of the blocks gathered into one buffer (one
  launch), one message, scattered into the receiver's blocks (one launch): latency from the send's
  start (gather included) to the end of the receiver's scatter (both clocks are the host's
  monotonic clock);
- per-layer: one message per layer's K and per layer's V (2 x layers messages), each gathered by
  itself and scattered by itself;
- copy: one device-to-device copy of the same bytes from cuda:0 to cuda:1 in one process (a peer
  copy over NVLink where the GPUs have peer access: the link's physical limit), timed with CUDA
  events; on the CPU a memory copy.

GB/s are bytes / latency (10^9 bytes). The fixed cost of a transfer is the staged time at the
smallest size (one block by default) and, with a least-squares line through the staged rows up to
`--fit-max-tokens`, its intercept (`fixed_ms`) and slope (`fit_gb_s`): what the simulator's link
prices as `overhead_s` and `bandwidth_gb_s` (conf/hardware `links`). Then `--batch` requests of
`--batch-tokens` each are moved as one message (the engine's hand-offs of one prefill step) and as
one message each, all posted at once: milliseconds for the lot and per request.

The whole run is bounded by `--budget-s`; sizes left when it runs out are reported as skipped.
Prints a table and, with `--out`, writes it as JSON.
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
from experiments.lib.kv_link_bench import LINK_TIMEOUT_S, random_caches, spread_blocks, sync_device

DEFAULT_TOKENS = "16,128,512,2048,8192,32768"


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
    k, v = random_caches(cfg, num_blocks, block_size, dev, dtype)
    link = KVLink(RECV_RANK, join_store(port, LINK_TIMEOUT_S), dev, LINK_TIMEOUT_S)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        layout, plan = msg
        if layout == "staged":  # plan: transfers, each a list of (key, blocks) parts
            transfers = [link.recv(parts, k) for parts in plan]
            conn.send("ready")
            done = link.wait_all(LINK_TIMEOUT_S)
            if len(done) != len(transfers) or any(t.error is not None for t in done):
                conn.send(("error", str(done[0].error if done else "timed out")))
                break
            for transfer in transfers:
                link.scatter(transfer, k, v)
        else:
            index = torch.tensor(plan, device=dev)
            conn.send("ready")
            _per_layer_recv(link, k, v, index)
        sync_device(dev)
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
    ap.add_argument("--fit-max-tokens", type=int, default=2048, help="fit the fixed cost over sizes up to this")
    ap.add_argument("--batch", type=int, default=16, help="requests moved in one message (0: skip)")
    ap.add_argument("--batch-tokens", type=int, default=512, help="tokens of each batched request")
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
    # The largest request (or the batch) fills at most half the cache.
    num_blocks = 2 * max(math.ceil(sizes[-1] / args.block_size), args.batch * math.ceil(args.batch_tokens / args.block_size))
    if args.device == "cuda":
        torch.cuda.set_device(send_dev)
    k, v = random_caches(cfg, num_blocks, args.block_size, send_dev, dtype)
    store = open_store(LINK_TIMEOUT_S)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_receiver, daemon=True,
                       args=(store.port, theirs, args.model, args.block_size, str(recv_dev), num_blocks))
    proc.start()
    link = KVLink(SEND_RANK, store, send_dev, LINK_TIMEOUT_S)
    rows, batch = [], None
    timed = _Timer(link, ours, k, v, send_dev, args.iters, started, args.budget_s)
    try:
        for tokens in sizes:
            n = math.ceil(tokens / args.block_size)
            row = {"tokens": tokens, "blocks": n, "bytes": n * block_bytes}
            for layout in ("staged", "per-layer"):
                seconds = timed(layout, lambda i, n=n: ([n], num_blocks, i))
                row[f"{layout}_ms"] = seconds * 1e3 if seconds else None
                row[f"{layout}_gbps"] = row["bytes"] / seconds / 1e9 if seconds else None
            copy_s = _copy_seconds(row["bytes"], send_dev, recv_dev, args.iters)
            row["copy_ms"], row["copy_gbps"] = copy_s * 1e3, row["bytes"] / copy_s / 1e9
            rows.append(row)
            if time.monotonic() - started > args.budget_s:
                break
        per = math.ceil(args.batch_tokens / args.block_size)
        if args.batch > 0 and time.monotonic() - started <= args.budget_s:
            one = timed("staged", lambda i: ([per] * args.batch, num_blocks, i))
            each = timed("staged", lambda i: ([per] * args.batch, num_blocks, i), one_message=False)
            batch = {"requests": args.batch, "tokens_each": args.batch_tokens, "bytes": args.batch * per * block_bytes,
                     "one_message_ms": one * 1e3 if one else None, "one_each_ms": each * 1e3 if each else None}
    finally:
        ours.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        link.close()
    fit = _fit([r for r in rows if r["tokens"] <= args.fit_max_tokens and r["staged_ms"] is not None])
    _print(rows, sizes, args, cfg, block_bytes, send_dev, fit, batch)
    if args.out is not None:
        args.out.write_text(json.dumps({"model": args.model, "device": _device_name(send_dev),
                                        "block_bytes": block_bytes, "rows": rows, **(fit or {}), "batch": batch},
                                       indent=1))


class _Timer:
    """The median latency of `iters` transfers (after two warm-ups) of a plan: `plan(i)` gives the
    requests' block counts, the pool size and a seed; the receiver posts first, then says ready."""

    def __init__(self, link: KVLink, conn, k, v, dev: torch.device, iters: int, started: float,
                 budget_s: float) -> None:
        self.link, self.conn, self.k, self.v, self.dev, self.iters = link, conn, k, v, dev, iters
        self.started, self.budget_s = started, budget_s

    def __call__(self, layout: str, plan, one_message: bool = True) -> float | None:
        lat = []
        for i in range(self.iters + 2):
            if time.monotonic() - self.started > self.budget_s:
                break
            counts, total, seed = plan(i)
            ours_all, theirs_all = spread_blocks(sum(counts), total, seed), spread_blocks(sum(counts), total, 1000 + seed)
            ours, theirs, at = [], [], 0
            for r, c in enumerate(counts):
                ours.append((f"r{r}", ours_all[at:at + c]))
                theirs.append((f"r{r}", theirs_all[at:at + c]))
                at += c
            ours_plan = [ours] if one_message else [[p] for p in ours]
            theirs_plan = [theirs] if one_message else [[p] for p in theirs]
            self.conn.send((layout, theirs_plan if layout == "staged" else theirs_all))
            if not self.conn.poll(LINK_TIMEOUT_S) or self.conn.recv() != "ready":
                raise SystemExit("error: the receiver did not answer")
            t0 = time.monotonic()
            if layout == "staged":
                for parts in ours_plan:
                    self.link.send(parts, self.k, self.v)
                self.link.wait_all(LINK_TIMEOUT_S)
            else:
                _per_layer_send(self.link, self.k, self.v, torch.tensor(ours_all, device=self.dev))
            if not self.conn.poll(LINK_TIMEOUT_S):
                raise SystemExit("error: the receiver did not finish a transfer")
            status, value = self.conn.recv()
            if status != "done":
                raise SystemExit(f"error: the transfer failed: {value}")
            if i >= 2:
                lat.append(value - t0)
        return statistics.median(lat) if lat else None


def _fit(rows: list[dict]) -> dict | None:
    """Least squares staged seconds = fixed + bytes / bandwidth over `rows` (at least two sizes)."""
    if len(rows) < 2:
        return None
    xs, ys = [r["bytes"] for r in rows], [r["staged_ms"] / 1e3 for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    return {"fixed_ms": fixed * 1e3, "fit_gb_s": 1 / slope / 1e9 if slope > 0 else None,
            "first_row_ms": rows[0]["staged_ms"]}


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (gloo)"


def _print(rows, sizes, args, cfg, block_bytes, dev, fit, batch) -> None:
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
    if fit:
        bw = f"{fit['fit_gb_s']:.1f} GB/s" if fit["fit_gb_s"] else "-"
        print(f"fixed cost per transfer: {fit['first_row_ms']:.3f} ms at {rows[0]['blocks']} block(s); fit over "
              f"<= {args.fit_max_tokens} tokens: {fit['fixed_ms']:.3f} ms + bytes / {bw}")
    if batch:
        n = batch["requests"]
        print(f"{n} requests x {batch['tokens_each']} tokens ({batch['bytes'] / 2**20:.0f} MiB): one message "
              f"{f(batch['one_message_ms'], '.3f')} ms ({f(batch['one_message_ms'] and batch['one_message_ms'] / n, '.3f')}"
              f" ms/request), one message each {f(batch['one_each_ms'], '.3f')} ms "
              f"({f(batch['one_each_ms'] and batch['one_each_ms'] / n, '.3f')} ms/request)")
    skipped = [t for t in sizes if t not in {r["tokens"] for r in rows}]
    if skipped:
        print(f"skipped (--budget-s={args.budget_s} spent): {skipped}")


if __name__ == "__main__":
    main()
