"""Turns scheduler-side requests into caller-facing outputs: detokenizes, applies stop strings,
groups the n choices of a request, and shapes logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.request import Request
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class RequestGroup:
    """A user's request: its prompt and its n choices."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    choices: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Whether every choice is done."""
        return all(o.finished for o in self.outputs)


class OutputProcessor:
    """Owns detokenizer state per request; runs on the event-loop thread."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self.group_of: dict[str, RequestGroup] = {}

    def add_group(self, request_id: str, prompt: str | None, choices: list[Request]) -> None:
        """Starts tracking a request's choices."""
        prompt_ids = choices[0].prompt_token_ids
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_ids, c.sampling_params)
                  for c in choices]
        group = RequestGroup(request_id, prompt, prompt_ids, choices, detoks,
                             [CompletionOutput(index=i) for i in range(len(choices))])
        self.groups[request_id] = group
        for choice in choices:
            self.group_of[choice.request_id] = group

    def process_tokens(self, requests: list[Request]) -> list[tuple[Request, str]]:
        """Detokenizes the newest token of each request; returns (request, stop string) hits."""
        stops = []
        for request in requests:
            group = self.group_of.get(request.request_id)
            if group is None:
                continue
            stop = group.detokenizers[request.choice_index].update(request.output_token_ids[-1])
            if stop is not None:
                stops.append((request, stop))
        return stops

    def make_outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per group touched this step; finished groups are dropped."""
        touched: dict[str, RequestGroup] = {}
        for request in requests:
            group = self.group_of.get(request.request_id)
            if group is not None:
                self._update_choice(group, request)
                touched[group.request_id] = group
        results = []
        for group in touched.values():
            results.append(RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                                         group.outputs, group.finished,
                                         max(group.choices[0].num_cached_tokens, 0)))
            if group.finished:
                self._drop(group)
        return results

    def _update_choice(self, group: RequestGroup, request: Request) -> None:
        out = group.outputs[request.choice_index]
        detok = group.detokenizers[request.choice_index]
        num_old = len(out.token_ids)
        out.delta_token_ids = request.output_token_ids[num_old:]
        out.token_ids = list(request.output_token_ids)
        out.finish_reason = request.finish_reason
        out.stop_reason = request.stop_reason
        out.delta_text = detok.take_delta(request.is_finished)
        out.text = detok.text if request.is_finished else detok.text[:detok.num_emitted]
        if request.sampling_params.logprobs is not None:
            self._update_logprobs(out, request, num_old)

    def _update_logprobs(self, out: CompletionOutput, request: Request, num_old: int) -> None:
        if out.logprobs is None:
            out.logprobs, out.cumulative_logprob = [], 0.0
        for pos in range(num_old, len(request.logprobs)):
            chosen_lp, top, rank = request.logprobs[pos]
            token = request.output_token_ids[pos]
            entry = {tid: Logprob(lp, r + 1, self._token_text(tid))
                     for r, (tid, lp) in enumerate(top)}
            entry[token] = Logprob(chosen_lp, rank, self._token_text(token))
            out.logprobs.append(entry)
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + chosen_lp

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def _drop(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for choice in group.choices:
            self.group_of.pop(choice.request_id, None)

    def choices_of(self, request_id: str) -> list[Request]:
        """The scheduler requests behind a user's request id."""
        group = self.groups.get(request_id)
        return list(group.choices) if group else []
