"""Parallel sampling (`n > 1`): one user request becomes n scheduler requests ("choices") that
share the prompt. Everything n-specific lives here: fanning a request out, the rule that
choices 2..n wait for choice 1's prompt, and which prompt blocks they share.

Choice 1 computes the prompt; its siblings are admitted once it has, and take its full prompt
blocks by reference instead of recomputing them (with or without prefix caching). Seeded
choices get distinct seeds so they do not all sample the same text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from engine.core.request import Request
from engine.sampling_params import SamplingParams

Block = TypeVar("Block")


@dataclass(eq=False)
class ParentRequest:
    """A user's request: its prompt and its n choices, in choice order."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    choices: list[Request]
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        """Whether every choice is done."""
        for choice in self.choices:  # a plain loop: read for every request every step
            if not choice.status.finished:
                return False
        return True


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's own for choice 0, then distinct 64-bit seeds."""
    if seed is None or index == 0:
        return seed
    return (seed + index + 2**63) % 2**64 - 2**63


def fan_out(request_id: str, prompt: str | None, prompt_ids: list[int],
            params: SamplingParams, eos_token_ids: frozenset[int], max_tokens: int,
            cache_salt: str | None = None) -> ParentRequest:
    """The n scheduler requests of one user request. With n == 1 the choice keeps the user's
    request id; otherwise choice i is `{request_id}-{i}`."""
    choices: list[Request] = []
    for i in range(params.n):
        seed = choice_seed(params.seed, i)
        child_params = params if seed == params.seed else replace(params, seed=seed)
        rid = request_id if params.n == 1 else f"{request_id}-{i}"
        choices.append(Request(rid, prompt_ids, child_params, eos_token_ids, max_tokens,
                               parent=choices[0] if choices else None, choice_index=i,
                               cache_salt=cache_salt))
    return ParentRequest(request_id, prompt, prompt_ids, choices)


def waits_for_sibling(request: Request) -> bool:
    """Choices 2..n wait until choice 1 has computed the prompt they will share."""
    parent = request.parent
    return (parent is not None and not parent.is_finished
            and parent.num_computed_tokens < parent.num_prompt_tokens)


def shared_prompt_blocks(request: Request, parent_blocks: Sequence[Block], block_size: int,
                         max_blocks: int) -> list[Block]:
    """The full prompt blocks choice 1 has computed, which a sibling takes by reference."""
    parent = request.parent
    if parent is None or parent.is_finished:
        return []
    num_prompt_blocks = min(request.num_prompt_tokens // block_size, max_blocks)
    num_ready = min(parent.num_computed_tokens // block_size, num_prompt_blocks)
    return list(parent_blocks[:num_ready])
