"""The token-budget scheduler: running requests first, then waiting ones, chunked prefill,
preemption by recompute. Only the event-loop thread touches this state."""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.parallel_sampling import waits_for_sibling
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from engine.core.step_budget import AdaptiveStepBudget
from engine.outputs import PositionLogprobs

# A decode row's token ids while its token is being sampled by the step in flight.
_PLACEHOLDER_ROW = (PLACEHOLDER_TOKEN_ID,)
_new_row = functools.partial(tuple.__new__, ScheduledRequest)  # positional, no checks


@dataclass
class SchedulerStats:
    """Counters the stats line and /metrics read."""

    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # whole prompts (cache hits included) once prefilled, as vLLM
    num_generation_tokens: int = 0


class Scheduler:
    """Decides, each step, which requests compute how many tokens."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, step_budget: AdaptiveStepBudget | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # None: the budget is max_num_batched_tokens every step (the flag was given).
        self.step_budget = step_budget
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: set[str] = set()
        # Requests ended without a token since the last take_failed() (a grammar failed to
        # compile); the engine hands them to output processing.
        self._failed: list[Request] = []

    def add_request(self, request: Request) -> None:
        """Queues a validated request."""
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Builds one step's batch under the token budget and the sequence cap."""
        budget = self.max_num_batched_tokens if self.step_budget is None else \
            self.step_budget.next_budget(self.running, self.waiting,
                                         lambda r: self._num_new_tokens(r, self.max_model_len))
        scheduled: list[tuple[Request, int]] = []
        budget, preempted = self._schedule_running(budget, scheduled)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        finished, self._finished_ids = frozenset(self._finished_ids), set()
        return SchedulerOutput(self._freeze_all(scheduled), finished)

    def _schedule_running(self, budget: int, out: list[tuple[Request, int]]) -> tuple[int, bool]:
        preempted = False
        running, kv = self.running, self.kv
        num_new_tokens, allocate, cache = self._num_new_tokens, kv.allocate_slots, \
            kv.cache_blocks
        # For the common case, read inline: a request whose held blocks already cover the
        # step, with no block filled since its last keying, needs neither call.
        req_blocks, num_cached, block_size = kv.req_blocks, kv.num_cached_blocks, kv.block_size
        append = out.append
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = num_new_tokens(request, budget)
            if num_new <= 0:  # async scheduling: the token in flight is its last
                i += 1
                continue
            end = request.num_computed_tokens + num_new
            held = req_blocks.get(request.request_id)
            if held is not None and len(held) * block_size >= end and \
                    min(end, len(request.all_token_ids)) // block_size <= \
                    num_cached.get(request.request_id, 0):
                append((request, num_new))  # allocate_slots and cache_blocks: no-ops here
                budget -= num_new
                i += 1
                continue
            while not allocate(request, num_new):
                victim = running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                cache(request, request.num_computed_tokens + num_new)
                append((request, num_new))
                budget -= num_new
                i += 1
        return budget, preempted

    def _schedule_waiting(self, budget: int, out: list[tuple[Request, int]]) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            if waits_for_sibling(request) or request.num_output_placeholders or \
                    not self._grammar_ready(request):
                if not request.is_finished:
                    skipped.append(request)
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                self.waiting.appendleft(request)
                break
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.kv.cache_blocks(request, num_hit_tokens + num_new)
            self.running.append(request)
            out.append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a structured-output request's grammar is compiled (always true without
        one); a grammar that failed to compile ends its request with an error."""
        grammar = request.grammar
        if grammar is None:
            return True
        if not grammar.done():
            return False
        if grammar.cancelled() or grammar.exception() is not None:
            self.finish(request, RequestStatus.FINISHED_ERROR)
            self._failed.append(request)
            return False
        return True

    def waiting_for_grammar(self) -> list[Request]:
        """Waiting requests whose grammar is still compiling."""
        return [r for r in self.waiting if r.grammar is not None and not r.grammar.done()]

    def take_failed(self) -> list[Request]:
        """Requests ended without a token since the last call (their grammar failed)."""
        failed, self._failed = self._failed, []
        return failed

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens a running request computes this step (AsyncScheduler counts those in
        flight)."""
        return min(len(request.all_token_ids) - request.num_computed_tokens, budget)

    def _freeze_all(self, scheduled: list[tuple[Request, int]]) -> tuple[ScheduledRequest, ...]:
        """The batch's rows, in scheduling order."""
        freeze = self._freeze
        return tuple([freeze(r, n) for r, n in scheduled])

    def _freeze(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        params = request.sampling_params
        pending = request.num_output_placeholders  # async scheduling: sampled, not yet known
        all_ids = request.all_token_ids
        num_tokens = len(all_ids)
        if num_new == 1 and not request.needs_history and request.grammar is None and (
                not params.min_tokens or
                len(request.output_token_ids) + pending >= params.min_tokens):
            # A plain decode row (every running request, every step): built positionally,
            # no history, no banned ids, no grammar; the same row the general path builds.
            return _new_row((request.request_id,
                             (all_ids[start],) if start < num_tokens else _PLACEHOLDER_ROW,
                             start, self.kv.block_table(request.request_id),
                             end == num_tokens + pending, params, (), (), (), None))
        history = request.needs_history
        tokens = all_ids[start:end]
        if len(tokens) < num_new:  # the worker fills these in from the step in flight
            tokens += [PLACEHOLDER_TOKEN_ID] * (num_new - len(tokens))
        banned: tuple[int, ...] = ()
        if request.num_output_tokens + pending < params.min_tokens:
            banned = tuple(params.stop_token_ids) + tuple(
                () if params.ignore_eos else request.eos_token_ids)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(tokens),
            start_pos=start,
            block_ids=self.kv.block_table(request.request_id),
            sample=end == num_tokens + pending,
            sampling_params=params,
            prompt_token_ids=tuple(request.prompt_token_ids) if history else (),
            output_token_ids=tuple(request.output_token_ids) if history else (),
            banned_token_ids=banned,
            grammar=request.grammar.result() if request.grammar is not None else None,
        )

    def update_from_output(self, batch: SchedulerOutput, sampled: dict[str, int],
                           logprobs: dict[str, PositionLogprobs],
                           grammar_terminated: Collection[str] = (),
                           grammar_rejected: Collection[str] = ()) -> list[Request]:
        """Advances counters, appends sampled tokens, finishes requests; returns those touched.
        A request whose grammar ended stops; one whose token its grammar refused fails."""
        touched = []
        for item in batch.requests:
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            request.num_computed_tokens += len(item.token_ids)
            if item.sample and item.request_id in sampled:
                if request.num_output_tokens == 0:  # prefill done: count the whole prompt,
                    self.stats.num_prompt_tokens += request.num_prompt_tokens  # as vLLM does
                request.append_output_token(sampled[item.request_id])
                if item.request_id in logprobs:
                    request.logprobs.append(logprobs[item.request_id])
                self._check_stop(request)
                if not request.is_finished and (grammar_terminated or grammar_rejected):
                    if item.request_id in grammar_rejected:
                        self.finish(request, RequestStatus.FINISHED_ERROR)
                    elif item.request_id in grammar_terminated:
                        self.finish(request, RequestStatus.FINISHED_STOPPED)
                touched.append(request)
        return touched

    def _check_stop(self, request: Request) -> None:
        self.stats.num_generation_tokens += 1
        self._apply_stop(request, request.output_token_ids[-1])

    def _apply_stop(self, request: Request, token: int) -> None:
        """Ends the request if its newest token `token` stops it (EOS, a stop token, max_tokens
        or max_model_len). Nothing can stop it unless the token is an EOS or stop id or a
        length limit is reached: callers may skip the call otherwise."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                return
            if token in params.stop_token_ids:
                request.stop_reason = token
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                return
        if num_output >= request.max_tokens or \
                len(request.all_token_ids) >= self.max_model_len:
            self.finish(request, RequestStatus.FINISHED_LENGTH)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request for any reason and frees its blocks at once."""
        if request.is_finished:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Aborts requests by id (unknown ids are ignored); returns the ones aborted."""
        aborted = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self.finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def fail_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finishes requests whose step failed, with finish_reason `error`."""
        failed = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self.kv.discard_uncomputed(request)
                self.finish(request, RequestStatus.FINISHED_ERROR)
                failed.append(request)
        return failed
