"""Shared by the engine tests: tiny random Llama / Qwen2 / Qwen3 checkpoints saved as local HF
directories (config.json + safetensors + a byte-level tokenizer), and transformers' greedy output."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

ARCH_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
VOCAB = 256  # one token per byte


def scheduling(ahead: bool) -> dict[str, bool]:
    """LLM / EngineArgs keywords: the default configuration (async scheduling) or synchronous steps."""
    return {} if ahead else {"async_scheduling": False}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2's byte-to-unicode map with no merges: token id == byte value, no special tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    rest = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(rest)}
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def save_tiny_model(path: Path, arch: str, seed: int = 0, with_tokenizer: bool = True):
    """Random weights large enough (initializer_range 0.3) that greedy choices are never near-ties."""
    torch.manual_seed(seed)
    cfg = ARCH_CONFIGS[arch](
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    if with_tokenizer:
        byte_tokenizer().save_pretrained(path)
    return model


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding), eos never ends it."""
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def ragged_prompts(num: int, seed: int = 0, min_len: int = 3, max_len: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]
