"""Async scheduling (vLLM V1's AsyncScheduler): the scheduler runs one step ahead of the model.

Step N+1 is scheduled while step N runs on the worker. So that it sees the work already handed
out, a request's counter advances when it is scheduled (not when its step returns), and each
token the step in flight will sample counts as an output placeholder: step N+1 computes that
token without knowing it (its id crosses as PLACEHOLDER_TOKEN_ID; the worker, which ran step N
first, fills it in from N's sampled tokens). When a step returns, `update_from_output`
reconciles: it appends the real tokens and applies the stop checks. A row whose request ended
meanwhile (EOS, a stop token or string, an abort) is dropped; its step was wasted work that no
output sees. No step is scheduled past max_tokens or max_model_len, so only stops that depend on
the token's value waste a row.

Exact because every sampled token reaches its request (a request preempted while its step ran
still gets that token, so its seeded generator is not one draw ahead), the worker applies
penalties with the filled-in history, and min_tokens counts placeholders. Structured-output
requests are the exception: while any is live the engine runs one step at a time
(`can_run_ahead`), so their grammars never see a token the scheduler has not.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.outputs import PositionLogprobs


class AsyncScheduler(Scheduler):
    """A Scheduler whose next batch may be built while the previous one is still running."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_grammar_requests = 0  # live structured-output requests
        self._frozen: list[Request] = []  # the request behind each row of the batch being built
        # The requests behind each scheduled batch's rows, by id(batch.requests) (a batch may be
        # rebuilt around the same rows), until it returns.
        self._in_flight: dict[int, list[Request]] = {}

    def can_run_ahead(self) -> bool:
        """Whether a step may be scheduled while another runs (no grammar is live)."""
        return self.num_grammar_requests == 0

    def add_request(self, request: Request) -> None:
        """Queues a validated request."""
        super().add_request(request)
        if request.grammar is not None:
            self.num_grammar_requests += 1

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request for any reason and frees its blocks at once."""
        if not request.is_finished and request.grammar is not None:
            self.num_grammar_requests -= 1
        super().finish(request, status)

    def schedule(self) -> SchedulerOutput:
        """Builds one step's batch; its requests' counters already include it."""
        batch = super().schedule()
        if batch.requests:
            self._in_flight[id(batch.requests)] = self._frozen
        self._frozen = []
        return batch

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        pending = request.num_output_placeholders
        if pending and (request.num_output_tokens + pending >= request.max_tokens
                        or request.num_tokens + pending >= self.max_model_len):
            return 0  # the token in flight is its last: computing past it would be wasted
        return min(request.num_tokens + pending - request.num_computed_tokens, budget)

    def _freeze(self, request: Request, num_new: int) -> ScheduledRequest:
        row = super()._freeze(request, num_new)
        request.num_computed_tokens += num_new
        if row.sample:
            request.num_output_placeholders += 1
        self._frozen.append(request)
        return row

    def update_from_output(self, batch: SchedulerOutput, sampled: dict[str, int],
                           logprobs: dict[str, PositionLogprobs],
                           grammar_terminated: Collection[str] = (),
                           grammar_rejected: Collection[str] = ()) -> list[Request]:
        """Reconciles a returned step: each placeholder becomes its sampled token (stop checks
        as in Scheduler), or is dropped if its request ended meanwhile. Returns those touched."""
        requests = self._in_flight.pop(id(batch.requests), [])
        block_size, caching = self.kv.block_size, self.kv.enable_caching
        touched = []
        for item, request in zip(batch.requests, requests, strict=True):
            if not item.sample:
                continue
            request.num_output_placeholders -= 1
            token = sampled.get(item.request_id)
            if request.status.finished or token is None:
                continue  # ended while the step ran: the token was wasted work
            if request.num_output_tokens == 0:  # prefill done: count the whole prompt, as vLLM
                self.stats.num_prompt_tokens += request.num_prompt_tokens
            request.append_output_token(token)
            if item.request_id in logprobs:
                request.logprobs.append(logprobs[item.request_id])
            self._check_stop(request)
            if not request.status.finished and (grammar_terminated or grammar_rejected):
                if item.request_id in grammar_rejected:
                    self.finish(request, RequestStatus.FINISHED_ERROR)
                elif item.request_id in grammar_terminated:
                    self.finish(request, RequestStatus.FINISHED_STOPPED)
            if caching and request.num_tokens % block_size == 0 and \
                    request.status is RequestStatus.RUNNING:
                # The block this token completes was computed, or is being, by a step already
                # scheduled; schedule() could not key it while the token was unknown.
                self.kv.cache_blocks(request, min(request.num_computed_tokens,
                                                  request.num_tokens))
            touched.append(request)
        return touched

    def fail_batch(self, batch: SchedulerOutput) -> list[Request]:
        """Finishes the requests of a step that raised, with finish_reason `error`, after
        taking back the progress it was credited with (so its unwritten blocks are uncached)."""
        failed = []
        for item, request in zip(batch.requests, self._in_flight.pop(id(batch.requests), []),
                                 strict=True):
            if item.sample:
                request.num_output_placeholders -= 1
            if request.status.finished:
                continue
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens = min(request.num_computed_tokens, item.start_pos)
            self.kv.discard_uncomputed(request)
            self.finish(request, RequestStatus.FINISHED_ERROR)
            failed.append(request)
        return failed
