"""The async front of the engine: one step-loop task on the event loop drives the LLMEngine.

Each iteration schedules a batch (event-loop thread), awaits the worker thread running the
model, applies the result, and pushes per-step deltas into each request's stream. HTTP keeps
being served while the worker computes. Aborts that arrive mid-step are applied right after
the step, so a step never finishes into blocks that were already handed to someone else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from engine.config import EngineArgs
from engine.core.request import Request
from engine.core.scheduler_output import SchedulerOutput, StepResult
from engine.llm_engine import LLMEngine, PromptInput
from engine.metrics import EngineMetrics, StatsLogger, StepTimes
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue-len; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The step loop stopped; no request can make progress."""


class RequestStream:
    """One request's deltas, in step order. Iterate it; `cancel()` aborts the request."""

    def __init__(self, request_id: str, engine: AsyncEngine, choices: list[Request]) -> None:
        self.request_id = request_id
        self.choices = choices
        self.finished = False
        self._engine = engine
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self.arrival_time = time.monotonic()
        self.last_token_times: list[float | None] = [None] * len(choices)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queues one step's output (or the error that ends the stream)."""
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._items:
            if self.finished:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def cancel(self) -> None:
        """Aborts the request unless it already finished; its blocks are freed."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs LLMEngine steps as one asyncio task; hands out per-request streams of deltas."""

    def __init__(self, engine: LLMEngine, model_name: str | None = None,
                 max_queue_len: int | None = None, stats_interval_s: float = 10.0) -> None:
        self.engine = engine
        self.model_name = model_name or engine.source.name
        self.max_queue_len = max_queue_len
        self.metrics = EngineMetrics(engine, self.model_name)
        self.step_times = StepTimes()
        self.stats_logger = StatsLogger(engine, stats_interval_s, self.step_times)
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: list[str] = []
        self._step_in_flight = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        self.num_steps = 0

    @classmethod
    def from_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncEngine:
        """Builds the engine (loads weights, sizes the KV cache) and its async front."""
        return cls(LLMEngine(args), **kwargs)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the step loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvserve-step")

    async def stop(self) -> None:
        """Stops the step loop, aborts what is left, and shuts the worker thread down."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._step_in_flight = False  # the loop is gone: abort now, not after a step
        self.abort_all("the server is shutting down")
        self.engine.shutdown()

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self._streams)

    @property
    def is_dead(self) -> bool:
        """Whether the step loop crashed."""
        return self._dead is not None

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt: PromptInput, params: SamplingParams,
                    request_id: str) -> RequestStream:
        """Validates and queues a request; raises ValueError (bad input), QueueFullError or
        EngineDeadError before anything is streamed."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self._dead}")
        if self.max_queue_len is not None and \
                len(self.engine.scheduler.waiting) >= self.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue_len} requests); "
                                 "retry later")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.engine.add_request(request_id, prompt, params)
        stream = RequestStream(request_id, self, self.engine.outputs.choices_of(request_id))
        self._streams[request_id] = stream
        self._wake.set()
        return stream

    async def generate(self, prompt: PromptInput, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per step with this step's deltas; cancelling the iteration
        (a client gone) aborts the request."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.cancel()

    def abort(self, request_id: str) -> None:
        """Aborts a request now, or right after the step in flight."""
        if self._step_in_flight:
            self._pending_aborts.append(request_id)
        else:
            self._abort_now(request_id)

    def abort_all(self, reason: str) -> None:
        """Ends every unfinished request's stream with EngineDeadError(reason) and aborts it
        (a drain that ran out of time): consumers see the error instead of a cut connection."""
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(reason))
            stream.cancel()

    def _abort_now(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)
        if stream is not None:
            self.metrics.request_finished("abort")

    # ---- the step loop --------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests():
                    self.stats_logger.idle()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._step()
                self.stats_logger.maybe_log()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug in scheduling or bookkeeping: fail loudly, once
            logger.exception("the engine step loop crashed")
            self._dead = exc
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(f"the engine stopped after an internal error: {exc}"))
            self._streams.clear()

    async def _step(self) -> None:
        engine, times = self.engine, self.step_times
        started = time.perf_counter()
        batch = engine.schedule()
        if not batch.requests:
            await asyncio.sleep(0.001)  # nothing admissible yet (a sibling waits); yield
            return
        self.metrics.iteration_tokens.observe(batch.num_tokens)
        self._step_in_flight = True
        scheduled = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            result, forward_s = await loop.run_in_executor(engine.worker, _timed_execute,
                                                           engine, batch)
            returned = time.perf_counter()
            outputs = engine.apply(batch, result)
        except Exception:
            logger.exception("a model step failed; its requests end with finish_reason=error")
            outputs, forward_s, returned = engine.fail(batch), 0.0, time.perf_counter()
        finally:
            self._step_in_flight = False
        self.num_steps += 1
        self._route(outputs, time.monotonic())
        pending, self._pending_aborts = self._pending_aborts, []
        for request_id in pending:
            self._abort_now(request_id)
        times.add(scheduled - started, forward_s, returned - scheduled - forward_s,
                  time.perf_counter() - returned)

    def _route(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted; nobody listens
            self._observe(stream, output, now)
            stream.put(_snapshot(output))
            if output.finished:
                del self._streams[output.request_id]

    def _observe(self, stream: RequestStream, output: RequestOutput, now: float) -> None:
        metrics = self.metrics
        for choice in output.outputs:
            if not choice.delta_token_ids:
                continue
            last = stream.last_token_times[choice.index]
            if last is None:
                metrics.ttft.observe(now - stream.arrival_time)
            else:
                metrics.itl.observe(now - last)
            stream.last_token_times[choice.index] = now
        if output.finished:
            metrics.e2e.observe(now - stream.arrival_time)
            scheduled = stream.choices[0].first_scheduled_time if stream.choices else None
            if scheduled is not None:
                metrics.queue_time.observe(max(0.0, scheduled - stream.choices[0].arrival_time))
            metrics.request_finished(output.outputs[0].finish_reason or "stop")


def _timed_execute(engine: LLMEngine, batch: SchedulerOutput) -> tuple[StepResult, float]:
    """Runs on the worker thread: the step and how long the model itself took."""
    started = time.perf_counter()
    result = engine.execute(batch)
    return result, time.perf_counter() - started


def _snapshot(output: RequestOutput) -> RequestOutput:
    """A copy whose per-step fields stay put while the engine moves on. Token id lists are
    replaced, never mutated, each step, and logprob lists only grow, so a shallow copy is
    enough: a consumer that lags a few steps still sees each step's own delta."""
    return dataclasses.replace(output, outputs=[dataclasses.replace(c) for c in output.outputs])
