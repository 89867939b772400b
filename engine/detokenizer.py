"""Incremental detokenization with stop strings.

Decoding only a short window of ids per step keeps the cost per token constant. Text that could
be the start of a stop string is held back from streaming until it is known not to be one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.sampling_params import SamplingParams

# ids, skip_special_tokens -> text
DecodeFn = Callable[[list[int], bool], str]

# Prompt ids kept as left context, so the first generated token decodes with the spacing it has
# after the prompt (SentencePiece drops a leading space at the start of a decode).
NUM_CONTEXT_IDS = 6


class IncrementalDetokenizer:
    """Turns one choice's sampled ids into text, step by step."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams,
                 decode: DecodeFn | None = None) -> None:
        self.tokenizer = tokenizer
        self._raw_decode = decode if decode is not None else fast_decoder(tokenizer)
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids = list(prompt_token_ids[-NUM_CONTEXT_IDS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.num_emitted = 0

    def update(self, token_id: int) -> str | None:
        """Adds one token; returns the stop string if the text now contains one."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for the next byte token
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return self._check_stop(len(delta))

    def _check_stop(self, delta_len: int) -> str | None:
        if not self.stop:
            return None
        search_from = max(0, len(self.text) - delta_len - self.hold)
        for stop in self.stop:
            idx = self.text.find(stop, search_from)
            if idx >= 0:
                self.text = self.text[:idx + (len(stop) if self.include_stop else 0)]
                return stop
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out, minus a tail that might still become a stop string."""
        end = len(self.text) if finished or not self.stop else max(
            self.num_emitted, len(self.text) - self.hold)
        delta = self.text[self.num_emitted:end]
        self.num_emitted = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(ids, self.skip_special)
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special))


def fast_decoder(tokenizer: Any) -> DecodeFn | None:
    """The Rust `tokenizers.Tokenizer.decode` behind a transformers tokenizer, when
    transformers' own `decode` would return exactly its text (no override, no clean-up): the
    wrapper's argument conversion cost more than the decode itself, twice per token. None
    otherwise (the wrapper is used)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or \
            cls.decode is not PreTrainedTokenizerBase.decode or \
            cls._decode is not TokenizersBackend._decode:
        return None
    if tokenizer.clean_up_tokenization_spaces:
        bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
        forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_"
                                    "corrupt_output", False)
        if not bpe or forced:
            return None
    backend: Any = tokenizer.backend_tokenizer  # the tokenizers.Tokenizer
    decode: DecodeFn = backend.decode
    return decode
