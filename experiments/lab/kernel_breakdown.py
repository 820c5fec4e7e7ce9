"""Per-kernel breakdown of a decode step: which part of the Llama layer each CUDA kernel is, how long
it ran, how many bytes it had to move at least, and the bandwidth that makes.

`classify(kernels)` labels a step's kernels in launch order from the layer's structure (the GEMMs of
a layer come as qkv -> [KV write, attention] -> o_proj -> gate_up -> down; a GEMM with no KV write
before the next GEMM is the LM head; an elementwise kernel is named by the GEMM before it).
`min_bytes(part, shape)` is the least DRAM traffic of a part for a decode batch of `rows` sequences
whose contexts sum to `context_tokens`: weights read once, activations read and written once, K/V
of every context token read once (bf16/fp16 models).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.config import ModelConfig

GEMM = re.compile(r"gemm|gemv|nvjet|sm90_|cutlass|xmma|ampere_", re.IGNORECASE)
GEMM_TAIL = re.compile(r"splitKreduce|splitk_reduce", re.IGNORECASE)  # a split-K GEMM's second kernel
KV_WRITE = re.compile(r"write_kv|rope_write", re.IGNORECASE)  # the KV write, alone or fused with q/k norm + rope
ATTENTION = re.compile(r"decode|attn|attention|prefill", re.IGNORECASE)
# The part an elementwise kernel belongs to, by the GEMM launched before it.
AFTER_GEMM = {None: "add + RMSNorm (input)", "down": "add + RMSNorm (input)", "qkv": "q/k norm + rope",
              "o_proj": "add + RMSNorm (post-attention)", "gate_up": "SiLU * mul",
              "lm_head": "sampler + next step's inputs"}
GEMM_PART = {"qkv": "qkv GEMM", "o_proj": "o_proj GEMM", "gate_up": "gate_up GEMM", "down": "down GEMM",
             "lm_head": "LM head GEMM"}
FUSED_WRITE = "q/k norm + rope + KV write"
PARTS = ("qkv GEMM", FUSED_WRITE, "KV-cache write", "decode attention", "o_proj GEMM", "gate_up GEMM", "down GEMM",
         "LM head GEMM", "add + RMSNorm (input)", "q/k norm + rope", "add + RMSNorm (post-attention)",
         "SiLU * mul", "sampler + next step's inputs", "other")


@dataclass(slots=True, frozen=True)
class Kernel:
    name: str
    start_us: float
    duration_us: float


@dataclass(slots=True, frozen=True)
class DecodeShape:
    rows: int  # sequences decoding, one token each
    context_tokens: int  # sum of their contexts (tokens whose K/V the attention reads)
    elem_bytes: int = 2


def classify(kernels: list[Kernel]) -> list[str]:
    """One part name (of PARTS) per kernel, for kernels sorted by start time."""
    labels: list[str] = []
    kinds = ["tail" if GEMM_TAIL.search(k.name) else "gemm" if GEMM.search(k.name)
             else "kv" if KV_WRITE.search(k.name) else "attn" if ATTENTION.search(k.name) else "elem"
             for k in kernels]
    last_gemm: str | None = None
    post_attention = 0  # GEMMs left in the layer after its KV write (o_proj, gate_up, down)
    for i, kind in enumerate(kinds):
        if kind == "kv":
            labels.append(FUSED_WRITE if "rope_write" in kernels[i].name else "KV-cache write")
            last_gemm, post_attention = "qkv", 3
        elif kind == "attn":
            labels.append("decode attention")
        elif kind == "tail":
            labels.append(GEMM_PART.get(last_gemm, "other"))
        elif kind == "gemm":
            if post_attention:
                last_gemm = ("down", "gate_up", "o_proj")[post_attention - 1]
                post_attention -= 1
            else:
                last_gemm = "qkv" if _kv_write_next(kinds, i) else "lm_head"
            labels.append(GEMM_PART[last_gemm])
        else:
            labels.append(AFTER_GEMM.get(last_gemm, "other"))
    return labels


def _kv_write_next(kinds: list[str], i: int) -> bool:
    """The next kernel after i that is not elementwise is a KV write."""
    for kind in kinds[i + 1:]:
        if kind not in ("elem", "tail"):
            return kind == "kv"
    return False


def min_bytes(part: str, cfg: ModelConfig, shape: DecodeShape) -> int:
    """Least bytes part `part` moves in one decode step, all layers together."""
    e, b, h = shape.elem_bytes, shape.rows, cfg.hidden_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    inter, layers = cfg.intermediate_size, cfg.num_hidden_layers

    def gemm(n_in: int, n_out: int) -> int:
        return e * (n_in * n_out + b * (n_in + n_out))

    per_layer = {
        "qkv GEMM": gemm(h, q + 2 * kv),
        "KV-cache write": e * b * 2 * kv * 2,
        "decode attention": e * (shape.context_tokens * 2 * kv + 2 * b * q),
        "o_proj GEMM": gemm(q, h),
        "gate_up GEMM": gemm(h, 2 * inter),
        "down GEMM": gemm(inter, h),
        "add + RMSNorm (input)": e * b * h * 4,
        "q/k norm + rope": e * b * (q + kv) * 2,
        "add + RMSNorm (post-attention)": e * b * h * 4,
        "SiLU * mul": e * b * 3 * inter,
    }
    per_layer[FUSED_WRITE] = per_layer["q/k norm + rope"] + per_layer["KV-cache write"]
    if part in per_layer:
        return layers * per_layer[part]
    if part == "LM head GEMM":
        return gemm(h, cfg.vocab_size)
    if part == "sampler + next step's inputs":
        return e * b * cfg.vocab_size
    return 0


def breakdown_rows(kernels: list[Kernel], steps: int, cfg: ModelConfig, shape: DecodeShape,
                   copy_bandwidth: float) -> list[dict]:
    """Rows of (part, kernels per step, us per step, share, min bytes, achieved TB/s, us at copy
    bandwidth), totals last."""
    labels = classify(kernels)
    per_part: dict[str, list[Kernel]] = {}
    for k, label in zip(kernels, labels, strict=True):
        per_part.setdefault(label, []).append(k)
    total_us = sum(k.duration_us for k in kernels) / steps
    rows = []
    for part in PARTS:
        ks = per_part.get(part, [])
        if not ks:
            continue
        us = sum(k.duration_us for k in ks) / steps
        nbytes = min_bytes(part, cfg, shape)
        names = sorted({k.name[:40] for k in ks})
        rows.append({"part": part, "kernels": round(len(ks) / steps, 1), "us": round(us, 1),
                     "share": round(us / total_us, 3), "min_MB": round(nbytes / 1e6, 2),
                     "TB_s": round(nbytes / us / 1e6, 2) if us else 0.0,
                     "us_at_copy_bw": round(nbytes / copy_bandwidth * 1e6, 1),
                     "names": "; ".join(names[:3])})
    total_bytes = sum(r["min_MB"] for r in rows) * 1e6
    rows.append({"part": "total", "kernels": round(len(kernels) / steps, 1), "us": round(total_us, 1),
                 "share": 1.0, "min_MB": round(total_bytes / 1e6, 2),
                 "TB_s": round(total_bytes / total_us / 1e6, 2),
                 "us_at_copy_bw": round(total_bytes / copy_bandwidth * 1e6, 1), "names": ""})
    return rows
