"""The worker side of structured outputs: one xgrammar GrammarMatcher per constrained request,
and one token bitmask for the batch.

Lives on the worker thread beside the sampler. A request's matcher is created the first time
the request samples (from the compiled grammar its ScheduledRequest carries) and advanced only
by the tokens it samples, so recomputation after a preemption, which samples nothing until it
reaches the end of the known tokens, never feeds it a token twice; the n choices of a request are
separate requests with separate matchers. Rows without a grammar cost one attribute test.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from engine.core.scheduler_output import ScheduledRequest

logger = logging.getLogger("kvserve")


@dataclass
class AcceptResult:
    """What the sampled tokens did to the grammars: requests whose grammar reached its end
    (they must stop, even with ignore_eos) and requests whose token the grammar refused."""

    terminated: set[str] = field(default_factory=set)
    rejected: set[str] = field(default_factory=set)


class GrammarMatchers:
    """Per-request matchers and the batch's bitmask."""

    def __init__(self) -> None:
        self.matchers: dict[str, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, CPU

    def forget(self, request_ids: frozenset[str]) -> None:
        """Drops the matchers of finished requests."""
        for rid in request_ids:
            self.matchers.pop(rid, None)

    @staticmethod
    def constrained_rows(rows: Sequence[ScheduledRequest]) -> list[int]:
        """Indexes of the rows that carry a grammar."""
        return [i for i, row in enumerate(rows) if row.grammar is not None]

    def mask(self, logits: torch.Tensor, rows: Sequence[ScheduledRequest],
             constrained: list[int]) -> None:
        """Sets, in place, the logits of tokens each constrained row's grammar forbids next to
        -inf; rows not in `constrained` are left alone."""
        bitmask = self._bitmask_for(len(rows), logits.shape[-1])
        for i in constrained:
            self._matcher(rows[i]).fill_next_token_bitmask(bitmask, i)
        if logits.device.type != "cpu":
            bitmask = bitmask[:len(rows)].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                        indices=constrained)

    def accept(self, rows: Sequence[ScheduledRequest], constrained: list[int],
               tokens: list[int]) -> AcceptResult:
        """Advances each constrained row's matcher by its sampled token."""
        result = AcceptResult()
        for i in constrained:
            rid = rows[i].request_id
            matcher = self._matcher(rows[i])
            if not matcher.accept_token(tokens[i]):
                logger.warning("request %s sampled token %d, which its grammar refuses",
                               rid, tokens[i])
                result.rejected.add(rid)
            elif matcher.is_terminated():
                result.terminated.add(rid)
        return result

    def _matcher(self, row: ScheduledRequest) -> xgr.GrammarMatcher:
        matcher = self.matchers.get(row.request_id)
        if matcher is None:
            assert row.grammar is not None
            matcher = xgr.GrammarMatcher(row.grammar)
            self.matchers[row.request_id] = matcher
        return matcher

    def _bitmask_for(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        bitmask = self._bitmask
        if bitmask is None or bitmask.shape[0] < num_rows or \
                bitmask.shape[1] != xgr.get_bitmask_shape(1, vocab_size)[1]:
            bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), vocab_size)
            self._bitmask = bitmask
        return bitmask
