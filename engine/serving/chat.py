"""Chat messages -> prompt token ids through the tokenizer's chat template (transformers' Jinja).

The template comes from the tokenizer (`tokenizer_config.json` or the GGUF's metadata); the server's
`--chat-template` (a file or an inline Jinja string) replaces it, e.g. for a tokenizer that has
none. The templated text is encoded without adding special tokens again (the template writes
them), as vLLM does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.serving.errors import APIError


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a path to a Jinja file, or the template itself; None keeps the tokenizer's."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"chat_template={value!r} is invalid: neither a file nor a Jinja template")
    return value


class ChatTemplate:
    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template

    @property
    def available(self) -> bool:
        return self.tokenizer is not None and (self.template is not None
                                               or getattr(self.tokenizer, "chat_template", None) is not None)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.tokenizer is None:
            raise APIError(400, "messages cannot be used with this model: it has no tokenizer (dummy "
                           "weights); use /v1/completions with token-id prompts", "messages")
        if not self.available:
            raise APIError(400, "messages cannot be used with this model: its tokenizer has no chat "
                           "template; start the server with --chat-template FILE", "messages")
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 (a template error is about the messages: roles, order)
            raise APIError(400, f"messages could not be rendered by the chat template: {exc}",
                           "messages") from None

    def encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self.render(messages, add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False))
