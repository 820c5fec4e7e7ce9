"""Incremental detokenization and stop strings, as vLLM does them.

Text is decoded from a window of a few earlier tokens so that byte-level merges and sentencepiece
leading spaces come out right, and nothing is emitted while the window ends in an incomplete UTF-8
character. The engine detokenizes step by step only for requests with stop strings or that stream
their outputs (output_kind cumulative or delta); everything else is decoded once, when it ends.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

# Tokens before the first unread one that are decoded again as context (vLLM uses 5 too).
_CONTEXT_TOKENS = 5


@dataclass(slots=True)
class DecodeState:
    """Per sequence: `text` covers token_ids[num_prompt_tokens:read_offset]."""

    prefix_offset: int
    read_offset: int
    text: str = ""
    stopped: str | None = None  # the stop string that ended the text, once found
    skip_special_tokens: bool = True
    flushed: bool = False  # the sequence ended and its text is complete


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # A fast tokenizer that cleans up nothing decodes exactly as its Rust backend does: called
        # directly, a decode costs a third (streaming decodes every token of every request).
        backend = getattr(tokenizer, "_tokenizer", None)
        if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._decode = backend.decode
        else:
            self._decode = tokenizer.decode

    def new_state(self, num_prompt_tokens: int, skip_special_tokens: bool = True) -> DecodeState:
        return DecodeState(prefix_offset=max(num_prompt_tokens - _CONTEXT_TOKENS, 0),
                           read_offset=num_prompt_tokens, skip_special_tokens=skip_special_tokens)

    def update(self, state: DecodeState, token_ids: list[int], pending: list[int] = (),
               final: bool = False, num_ids: int | None = None) -> int:
        """Decode what follows `state.read_offset` in `token_ids[:num_ids] + pending` into state.text
        (pending: tokens sampled this step, not in the sequence yet; num_ids: None for all of
        token_ids); returns the chars added. `final`: the sequence ended, so an incomplete trailing
        character is emitted as U+FFFD."""
        num_ids = len(token_ids) if num_ids is None else num_ids
        end = num_ids + len(pending)
        if state.read_offset >= end:
            return 0
        decode = self._decode
        skip = state.skip_special_tokens
        window = token_ids[state.prefix_offset:num_ids]
        if pending:
            window = window + list(pending)
        prefix_text = decode(window[:state.read_offset - state.prefix_offset], skip_special_tokens=skip)
        full_text = decode(window, skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return 0  # an incomplete character (or nothing visible yet): wait for more tokens
        new_text = full_text[len(prefix_text):]
        state.text += new_text
        state.prefix_offset = state.read_offset
        state.read_offset = end
        return len(new_text)

    def decode_output(self, token_ids: list[int], num_prompt_tokens: int, skip_special_tokens: bool = True,
                      num_ids: int | None = None) -> str:
        """The whole output text of `token_ids[:num_ids]` at once (the same decoding, one window)."""
        state = self.new_state(num_prompt_tokens, skip_special_tokens)
        self.update(state, token_ids, final=True, num_ids=num_ids)
        return state.text


def find_stop_string(state: DecodeState, new_chars: int, stop: list[str], include: bool = False) -> bool:
    """vLLM's check: look for a stop string overlapping the `new_chars` just added; if found,
    truncate the text right before it (right after it with `include`, vLLM's
    include_stop_str_in_output), remember which one, and return True."""
    if new_chars == 0:
        return False
    text = state.text
    for stop_str in stop:
        start = max(len(text) - new_chars - len(stop_str) + 1, 0)
        index = text.find(stop_str, start)
        if index != -1:
            state.text = text[:index + len(stop_str) if include else index]
            state.stopped = stop_str
            return True
    return False
