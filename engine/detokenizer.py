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
                 decode: DecodeFn | None = None, singles: dict[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self._raw_decode = decode if decode is not None else fast_decoder(tokenizer)
        # (ids, skip_special_tokens) -> text: the fast decoder, else the tokenizer's decode.
        self._decode_ids: DecodeFn = self._raw_decode if self._raw_decode is not None else \
            self._tokenizer_decode
        self.skip_special = params.skip_special_tokens
        # Token id -> its text decoded alone (a pure function of the id, shared by every
        # detokenizer of one tokenizer and skip_special_tokens setting: see DecodeCache).
        # Once text flows, each step's prefix is the one token the last step added.
        self.singles: dict[int, str] = {} if singles is None else singles
        # Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): the text of a run of ids is its tokens'
        # bytes decoded as one, so once the last token's text is complete the next one's is
        # exactly what it adds (see update).
        self.additive = self._raw_decode is not None and is_byte_level(tokenizer)
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
        ids = self.ids
        ids.append(token_id)
        decode, skip = self._decode_ids, self.skip_special
        prefix_offset, read_offset = self.prefix_offset, self.read_offset
        if self.additive and read_offset - prefix_offset == 1 and len(ids) == read_offset + 1:
            # The usual step: the last token's text was complete (it advanced the offsets, and
            # no token waits behind it); when this one's is complete too (no replacement
            # character from a partial UTF-8 sequence, nothing skipped), the pair decodes to the
            # two texts joined, so its delta is its own text, with no decode of the pair.
            singles = self.singles
            delta = singles.get(token_id)
            if delta is None:
                delta = singles[token_id] = decode([token_id], skip)
            prefix = singles.get(ids[prefix_offset])
            if delta and prefix and "\ufffd" not in delta and "\ufffd" not in prefix:
                self.prefix_offset, self.read_offset = read_offset, len(ids)
                self.text += delta
                return self._check_stop(len(delta)) if self.stop else None
        if read_offset - prefix_offset == 1:
            prefix = self.singles.get(ids[prefix_offset])
            if prefix is None:
                prefix = self.singles[ids[prefix_offset]] = decode(ids[prefix_offset:read_offset],
                                                                   skip)
        else:
            prefix = decode(ids[prefix_offset:read_offset], skip)
        full = decode(ids[prefix_offset:], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for the next byte token
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = read_offset, len(ids)
        self.text += delta
        return self._check_stop(len(delta)) if self.stop else None

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
        return self._decode_ids(ids, self.skip_special)

    def _tokenizer_decode(self, ids: list[int], skip_special: bool) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special))


class DecodeCache:
    """The single-token texts of one tokenizer, per skip_special_tokens setting, shared by
    its detokenizers (at most one entry per vocabulary id each)."""

    def __init__(self) -> None:
        self._by_skip: dict[bool, dict[int, str]] = {True: {}, False: {}}

    def singles(self, skip_special_tokens: bool) -> dict[int, str]:
        """The id -> text dict for this setting."""
        return self._by_skip[bool(skip_special_tokens)]


def is_byte_level(tokenizer: Any) -> bool:
    """Whether the Rust tokenizer behind `tokenizer` decodes with the byte-level decoder alone
    (no Strip, Replace or ByteFallback steps that depend on a token's neighbours)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


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
