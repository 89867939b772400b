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
        num_tokens = len(request.all_token_ids)
        if pending and (len(request.output_token_ids) + pending >= request.max_tokens
                        or num_tokens + pending >= self.max_model_len):
            return 0  # the token in flight is its last: computing past it would be wasted
        return min(num_tokens + pending - request.num_computed_tokens, budget)

    def _freeze_all(self, scheduled: list[tuple[Request, int]]) -> tuple[ScheduledRequest, ...]:
        """The rows, each request's counters advanced past its row (and a placeholder counted
        for each token it samples)."""
        freeze = self._freeze
        rows = []
        for request, num_new in scheduled:
            row = freeze(request, num_new)
            request.num_computed_tokens += num_new
            if row.sample:
                request.num_output_placeholders += 1
            rows.append(row)
        self._frozen = [request for request, _ in scheduled]
        return tuple(rows)

    def update_from_output(self, batch: SchedulerOutput, sampled: dict[str, int],
                           logprobs: dict[str, PositionLogprobs],
                           grammar_terminated: Collection[str] = (),
                           grammar_rejected: Collection[str] = ()) -> list[Request]:
        """Reconciles a returned step: each placeholder becomes its sampled token (stop checks
        as in Scheduler), or is dropped if its request ended meanwhile. Returns those touched."""
        requests = self._in_flight.pop(id(batch.requests), [])
        kv, stats, max_model_len = self.kv, self.stats, self.max_model_len
        block_size, caching = kv.block_size, kv.enable_caching
        grammar_ended = bool(grammar_terminated or grammar_rejected)
        running = RequestStatus.RUNNING
        get_token, apply_stop = sampled.get, self._apply_stop
        touched: list[Request] = []
        append = touched.append
        for item, request in zip(batch.requests, requests, strict=True):
            if not item.sample:
                continue
            request.num_output_placeholders -= 1
            rid = item.request_id
            token = get_token(rid)
            if token is None or request.status.finished:
                continue  # ended while the step ran: the token was wasted work
            output, all_ids = request.output_token_ids, request.all_token_ids
            if not output:  # prefill done: count the whole prompt, as vLLM
                stats.num_prompt_tokens += len(request.prompt_token_ids)
            output.append(token)
            all_ids.append(token)
            if logprobs and rid in logprobs:
                request.logprobs.append(logprobs[rid])
            stats.num_generation_tokens += 1
            params = request.sampling_params
            if token in request.eos_token_ids or token in params.stop_token_ids or \
                    len(output) >= request.max_tokens or len(all_ids) >= max_model_len:
                apply_stop(request, token)  # only these can stop it (Scheduler._apply_stop)
            if grammar_ended and not request.status.finished:
                if rid in grammar_rejected:
                    self.finish(request, RequestStatus.FINISHED_ERROR)
                elif rid in grammar_terminated:
                    self.finish(request, RequestStatus.FINISHED_STOPPED)
            if caching and len(all_ids) % block_size == 0 and request.status is running:
                # The block this token completes was computed, or is being, by a step already
                # scheduled; schedule() could not key it while the token was unknown.
                kv.cache_blocks(request, min(request.num_computed_tokens, len(all_ids)))
            append(request)
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


class BatchQueueScheduler(AsyncScheduler):
    """Pipeline parallelism's batch queue (vLLM V1's): up to one batch per stage in flight,
    each of different requests. A request whose sampled token is still in flight is not
    scheduled again until that step returns: the first stage would need the token before the
    last stage has sampled it. A prefill chunk that samples nothing does not hold its request
    back: every stage runs the batches in order, so the next chunk's attention on a stage finds
    the previous chunk's K/V there. Each batch takes at most 1/num_stages of the live requests,
    so they spread over the stages' batches rather than all riding in one (which would leave
    every other stage idle, as with one batch in flight)."""

    def __init__(self, *args: Any, num_stages: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_stages = num_stages
        self._rows_left: int | None = None  # rows this batch may still take, while scheduling
        self._counting = False  # inside _schedule_running (not the step budget's estimates)

    def schedule(self) -> SchedulerOutput:
        live = len(self.running) + len(self.waiting)
        self._rows_left = -(-live // self.num_stages)
        try:
            return super().schedule()
        finally:
            self._rows_left = None

    def _schedule_running(self, budget: int, out: list[tuple[Request, int]]) -> tuple[int, bool]:
        self._counting = True
        try:
            return super()._schedule_running(budget, out)
        finally:
            self._counting = False

    def _schedule_waiting(self, budget: int, out: list[tuple[Request, int]]) -> None:
        cap = self.max_num_seqs
        if self._rows_left is not None:  # admit no more than the rows this batch has left
            self.max_num_seqs = min(cap, len(self.running) + max(0, self._rows_left))
        try:
            super()._schedule_waiting(budget, out)
        finally:
            self.max_num_seqs = cap

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if request.num_output_placeholders:
            return 0
        num_new = super()._num_new_tokens(request, budget)
        if self._counting and self._rows_left is not None and num_new > 0:
            if self._rows_left <= 0:
                return 0
            self._rows_left -= 1
        return num_new
