"""Input processing, in one place: render a chat, tokenize, check token ids and lengths, and fan
a request out into its n choices. Every refusal is an `InvalidRequestError` naming the
parameter, raised before anything is queued."""

from __future__ import annotations

from typing import Any

from engine.core.parallel_sampling import ParentRequest, fan_out
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.structured_output.constraints import validate as validate_structured_outputs

# A prompt: text, token ids, or a dict with "prompt" and/or "prompt_token_ids" (and optionally
# "cache_salt"), as vLLM's prompt inputs.
PromptInput = str | list[int] | dict[str, Any]
Message = dict[str, Any]


class InputProcessor:
    """Turns prompts into validated scheduler requests for one model and cache size."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, block_size: int,
                 num_blocks: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.eos_token_ids = eos_token_ids

    def process(self, request_id: str, prompt: PromptInput,
                params: SamplingParams) -> ParentRequest:
        """The request's choices, or InvalidRequestError saying what to change."""
        text, prompt_ids = self.tokenize_prompt(prompt)
        max_tokens = self._check_lengths(len(prompt_ids), params)
        self._check_constraints(params)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
        return fan_out(request_id, text, prompt_ids, params, self.eos_token_ids, max_tokens,
                       salt)

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    chat_template: str | None = None,
                    tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A conversation rendered with the model's chat template, as a prompt dict."""
        if not messages:
            raise InvalidRequestError("a conversation needs at least one message", "messages")
        try:
            text = str(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                chat_template=chat_template, tools=tools))
        except Exception as exc:  # jinja errors, missing template
            raise InvalidRequestError(
                f"the chat template could not render these messages: {exc}", "messages") from exc
        # The template already wrote BOS and role markers as text.
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[Any], param: str = "tokens") -> str:
        """The text of token ids, checked against the vocabulary first."""
        return str(self.tokenizer.decode(self.check_token_ids(token_ids, param)))

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of any prompt form."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'",
                                      "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty; give at least one token of text",
                                          "prompt")
            return prompt, self.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self.check_token_ids(list(prompt))
        raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict, "
                                  f"not {type(prompt).__name__}", "prompt")

    def check_token_ids(self, ids: list[Any], param: str = "prompt") -> list[int]:
        """The ids as ints; refused when empty or outside the vocabulary (before anything
        decodes or embeds them)."""
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token", param)
        vocab = self.vocab_size
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"token id {token!r} is outside the vocabulary [0, {vocab})", param)
        return [int(t) for t in ids]

    def _check_constraints(self, params: SamplingParams) -> None:
        """logit_bias token ids inside the vocabulary; a structured-output constraint that
        parses (an invalid JSON schema, regex or grammar names the problem)."""
        if params.logit_bias:
            for token in params.logit_bias:
                if not 0 <= token < self.vocab_size:
                    raise InvalidRequestError(
                        f"logit_bias token id {token} is outside the vocabulary "
                        f"[0, {self.vocab_size})", "logit_bias")
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)

    def _check_lengths(self, num_prompt: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens, but max_model_len is {limit}: shorten the "
                "prompt or raise --max-model-len", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt + max_tokens} exceeds max_model_len ({limit}); lower max_tokens or "
                "shorten the prompt", "max_tokens")
        # Startup makes max_model_len fit the cache, so this holds already; it stays as the
        # guard against queueing a request that could never be scheduled (it would wait forever).
        total, block_size = num_prompt + max_tokens, self.block_size
        needed_blocks = -(-total // block_size)
        if needed_blocks > self.num_blocks:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} tokens need "
                f"{needed_blocks} KV blocks, but the whole KV cache holds {self.num_blocks} blocks "
                f"({self.num_blocks * block_size} tokens); lower max_tokens, shorten the prompt or "
                "give the cache more memory", "max_tokens")
        return max_tokens
