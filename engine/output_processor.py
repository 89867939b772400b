"""Output processing: the one loop over a step's results.

For every request that got a token it detokenizes (stop strings end the request here), names
the logprobs' tokens once, records the latency metrics and builds the caller's output: each
step's delta for streaming requests (RequestOutputKind.DELTA), or the whole output once the
request ends (FINAL_ONLY). Outputs go to the request's stream when it has one. Runs on the
event-loop thread, beside the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.core.parallel_sampling import ParentRequest
from engine.core.request import FINISH_REASONS, Request
from engine.detokenizer import DecodeCache, IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind


class OutputStream(Protocol):
    """Where a streaming request's outputs go (the async engine's per-request queue)."""

    def put(self, item: RequestOutput | BaseException) -> None: ...


class RequestMetrics(Protocol):
    """The latency observations the output processor makes (the Prometheus histograms)."""

    def observe_token(self, since_previous: float, first: bool) -> None: ...

    def observe_tokens(self, since_previous: float, count: int) -> None:
        """`count` tokens, none a first, each `since_previous` after its previous one."""
        ...

    def observe_finished(self, e2e: float | None, queue_time: float | None,
                         reason: str) -> None: ...


@dataclass
class _ChoiceState:
    detokenizer: IncrementalDetokenizer
    num_sent_tokens: int = 0  # output tokens already handed out (the next delta starts here)
    last_token_time: float | None = None


@dataclass
class _RequestState:
    parent: ParentRequest
    choices: list[_ChoiceState]
    stream: OutputStream | None
    kind: RequestOutputKind
    touched: set[int] = field(default_factory=set)  # choice indexes with news this step (n > 1)
    streams_deltas: bool = False  # n == 1 and DELTA: its output is built as its token lands


class OutputProcessor:
    """Owns each live request's detokenizers, stream and output state."""

    def __init__(self, tokenizer: Any, finish_stopped: Callable[[Request], None]) -> None:
        self.tokenizer = tokenizer
        self._finish_stopped = finish_stopped  # the scheduler ends a request a stop string hit
        self.metrics: RequestMetrics | None = None
        self._requests: dict[str, _RequestState] = {}
        self._by_choice: dict[str, tuple[_RequestState, _ChoiceState]] = {}
        self._decode_cache = DecodeCache()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_unfinished(self) -> int:
        """User requests not yet finished."""
        return len(self._requests)

    def streams(self) -> list[OutputStream]:
        """The streams of every unfinished request."""
        return [s.stream for s in self._requests.values() if s.stream is not None]

    def drop_all(self) -> list[OutputStream]:
        """Forgets every request (the step loop died); returns their streams to end."""
        streams = self.streams()
        self._requests.clear()
        self._by_choice.clear()
        return streams

    def add_request(self, parent: ParentRequest, stream: OutputStream | None = None) -> None:
        """Starts tracking a user request and its choices."""
        params = parent.choices[0].sampling_params
        state = _RequestState(parent, [], stream, params.output_kind, streams_deltas=len(
            parent.choices) == 1 and params.output_kind is RequestOutputKind.DELTA)
        for choice in parent.choices:
            detok = IncrementalDetokenizer(
                self.tokenizer, parent.prompt_token_ids, choice.sampling_params,
                singles=self._decode_cache.singles(choice.sampling_params.skip_special_tokens))
            state.choices.append(_ChoiceState(detok))
            self._by_choice[choice.request_id] = (state, state.choices[-1])
        self._requests[parent.request_id] = state

    def choices_of(self, request_id: str) -> list[Request]:
        """The scheduler requests behind a user request id."""
        state = self._requests.get(request_id)
        return list(state.parent.choices) if state else []

    def process(self, requests: list[Request], now: float) -> list[RequestOutput]:
        """Handles the requests that sampled a token this step; returns the outputs made, in
        the order their requests first appear."""
        results: list[RequestOutput | _RequestState] = []
        touched: set[str] = set()  # the n > 1 requests already in `results`
        by_choice, finish_stopped = self._by_choice, self._finish_stopped
        ttfts: list[float] = []
        gaps: dict[float, int] = {}  # previous token's time -> tokens (one observation each)
        for request in requests:
            entry = by_choice.get(request.request_id)
            if entry is None:
                continue
            state, choice = entry
            stop = choice.detokenizer.update(request.output_token_ids[-1])
            if stop is not None:
                request.stop_reason = stop
                finish_stopped(request)
            wants_logprobs = request.sampling_params.logprobs is not None
            if wants_logprobs:
                self._name_logprobs(request)
            last = choice.last_token_time
            if last is None:
                ttfts.append(now - state.parent.arrival_time)
            else:
                gaps[last] = gaps.get(last, 0) + 1
            choice.last_token_time = now
            if state.streams_deltas:  # streaming, n == 1: its output now
                # (`_emit` and `_delta` inlined: this runs for every request every step)
                parent = state.parent
                finished = request.status.finished
                if finished:
                    self._drop(state)
                    self._observe_finished(parent, now)
                output_ids = request.output_token_ids
                start, choice.num_sent_tokens = choice.num_sent_tokens, len(output_ids)
                output = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, [
                    CompletionOutput(
                        request.choice_index, choice.detokenizer.take_delta(finished),
                        output_ids[start:], None,
                        request.logprobs[start:] if wants_logprobs else None,
                        FINISH_REASONS.get(request.status) if finished else None,
                        request.stop_reason)], finished, max(request.num_cached_tokens, 0))
                if state.stream is not None:
                    state.stream.put(output)
                results.append(output)
            else:
                state.touched.add(request.choice_index)
                if state.parent.request_id not in touched:
                    touched.add(state.parent.request_id)
                    results.append(state)
        metrics = self.metrics
        if metrics is not None:
            for ttft in ttfts:
                metrics.observe_token(ttft, True)
            for last, count in gaps.items():
                metrics.observe_tokens(now - last, count)
        outputs: list[RequestOutput] = []
        for item in results:
            if isinstance(item, RequestOutput):
                outputs.append(item)
            elif (out := self._emit(item, now)) is not None:
                outputs.append(out)
        return outputs

    def finish_without_token(self, requests: list[Request], now: float) -> list[RequestOutput]:
        """Outputs for requests the scheduler ended without a new token (a failed step)."""
        touched: dict[str, _RequestState] = {}
        for request in requests:
            entry = self._by_choice.get(request.request_id)
            if entry is not None:
                entry[0].touched.add(request.choice_index)
                touched[entry[0].parent.request_id] = entry[0]
        return [out for state in touched.values()
                if (out := self._emit(state, now)) is not None]

    def abort(self, request_id: str) -> bool:
        """Forgets an aborted request (its stream was cancelled); whether it was live."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        self._drop(state)
        if self.metrics is not None:
            self.metrics.observe_finished(None, None, "abort")
        return True

    def _name_logprobs(self, request: Request) -> None:
        """Fills in the text of the newest position's logprob tokens."""
        for logprob_id, logprob in request.logprobs[-1].items():
            logprob.decoded_token = str(self.tokenizer.decode([logprob_id]))

    def _emit(self, state: _RequestState, now: float) -> RequestOutput | None:
        parent = state.parent
        choices = parent.choices
        if len(choices) == 1:  # most requests: no index bookkeeping
            request = choices[0]
            finished = request.status.finished
            if state.kind is RequestOutputKind.DELTA:
                outputs = [self._delta(request, state.choices[0], finished)]
            elif not finished:
                return None
            else:
                outputs = [self._completion(request, state.choices[0], state.kind)]
        else:
            finished = parent.finished
            if state.kind is RequestOutputKind.FINAL_ONLY and not finished:
                state.touched.clear()
                return None
            indexes = sorted(state.touched) if state.kind is RequestOutputKind.DELTA else \
                range(len(choices))
            outputs = [self._completion(choices[i], state.choices[i], state.kind)
                       for i in indexes]
            state.touched.clear()
        if finished:
            self._drop(state)
            self._observe_finished(parent, now)
        output = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                               outputs, finished, max(choices[0].num_cached_tokens, 0))
        if state.stream is not None:
            state.stream.put(output)
        return output

    @staticmethod
    def _delta(request: Request, choice: _ChoiceState, finished: bool) -> CompletionOutput:
        """A streaming choice's news since its last output."""
        start = choice.num_sent_tokens
        output_ids = request.output_token_ids
        choice.num_sent_tokens = len(output_ids)
        status = request.status
        return CompletionOutput(
            request.choice_index, choice.detokenizer.take_delta(finished),
            output_ids[start:], None,
            request.logprobs[start:] if request.sampling_params.logprobs is not None else None,
            FINISH_REASONS.get(status) if finished else None, request.stop_reason)

    def _completion(self, request: Request, choice: _ChoiceState,
                    kind: RequestOutputKind) -> CompletionOutput:
        if kind is not RequestOutputKind.FINAL_ONLY:
            return self._delta(request, choice, request.is_finished)
        detok, wants_logprobs = choice.detokenizer, request.sampling_params.logprobs is not None
        cumulative = sum(entry[token].logprob for entry, token in zip(
            request.logprobs, request.output_token_ids, strict=True)) \
            if wants_logprobs else None
        return CompletionOutput(request.choice_index, detok.text,
                                list(request.output_token_ids), cumulative,
                                list(request.logprobs) if wants_logprobs else None,
                                request.finish_reason, request.stop_reason)

    def _observe_finished(self, parent: ParentRequest, now: float) -> None:
        if self.metrics is None:
            return
        first = parent.choices[0]
        scheduled = first.first_scheduled_time
        queue = max(0.0, scheduled - parent.arrival_time) if scheduled is not None else None
        self.metrics.observe_finished(now - parent.arrival_time, queue,
                                      first.finish_reason or "stop")

    def _drop(self, state: _RequestState) -> None:
        self._requests.pop(state.parent.request_id, None)
        for choice in state.parent.choices:
            self._by_choice.pop(choice.request_id, None)
