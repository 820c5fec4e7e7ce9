"""The decode-step breakdown labels kernels by the layer's structure and prices their least bytes."""
from engine.config import ModelConfig
from experiments.lab.kernel_breakdown import DecodeShape, Kernel, breakdown_rows, classify

LAYER = ["triton_red_fused_add_rms", "nvjet_tst_qkv", "triton_per_fused_rope", "_write_kv_kernel",
         "_tma_decode_kernel", "nvjet_tst_o", "triton_red_fused_add_rms", "nvjet_tst_gate_up",
         "triton_poi_fused_silu_mul", "nvjet_tst_down", "splitKreduce_kernel"]
TAIL = ["triton_red_fused_add_rms", "nvjet_tst_lm_head", "triton_poi_exponential", "triton_red_argmax"]


def _kernels(names: list[str]) -> list[Kernel]:
    return [Kernel(n, float(i), 1.0) for i, n in enumerate(names)]


def test_classify_follows_the_layer_structure() -> None:
    labels = classify(_kernels(LAYER * 2 + TAIL))
    layer = ["add + RMSNorm (input)", "qkv GEMM", "q/k norm + rope", "KV-cache write", "decode attention",
             "o_proj GEMM", "add + RMSNorm (post-attention)", "gate_up GEMM", "SiLU * mul", "down GEMM",
             "down GEMM"]
    assert labels == layer * 2 + ["add + RMSNorm (input)", "LM head GEMM", "sampler + next step's inputs",
                                  "sampler + next step's inputs"]


def test_bytes_and_bandwidth() -> None:
    cfg = ModelConfig(name="t", architecture="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
                      max_position_embeddings=256, rope_theta=1e6, rope_scaling=None, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, attention_bias=False, dtype="bfloat16", weights="dummy")
    rows = {r["part"]: r for r in breakdown_rows(_kernels(LAYER * 2 + TAIL), 1, cfg,
                                                  DecodeShape(rows=4, context_tokens=100), 1e12)}
    # K and V of 100 tokens, 2 KV heads x 16 dims, 2 bytes, 2 layers, plus q in and out
    assert rows["decode attention"]["min_MB"] == round(2 * 2 * (100 * 2 * 32 + 2 * 4 * 64) / 1e6, 2)
    assert rows["down GEMM"]["kernels"] == 4 and rows["down GEMM"]["us"] == 4.0
    assert rows["total"]["us"] == len(LAYER) * 2 + len(TAIL)


def test_the_fused_rope_and_kv_write_kernel_is_one_part() -> None:
    layer = [n for n in LAYER if n not in ("triton_per_fused_rope", "_write_kv_kernel")]
    layer.insert(2, "_qk_norm_rope_write_kernel")
    labels = classify(_kernels(layer + TAIL))
    assert labels[:6] == ["add + RMSNorm (input)", "qkv GEMM", "q/k norm + rope + KV write", "decode attention",
                          "o_proj GEMM", "add + RMSNorm (post-attention)"]
    assert labels[-3] == "LM head GEMM"
