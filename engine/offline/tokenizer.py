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


def encode_prompt(tokenizer: PreTrainedTokenizerBase | None, prompt: str) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"prompt={prompt[:40]!r} is invalid: this model has no tokenizer "
                         "(dummy weights); pass token ids instead of text")
    return list(tokenizer.encode(prompt))
