"""The async front of the engine: one step-loop task on the event loop drives the LLMEngine.

Each iteration schedules a batch (event-loop thread) and hands it to the worker thread; with
async scheduling (the default) it then schedules the next batch at once, so one step is always
queued behind the one running, and only then awaits the oldest step and applies its result; the
output processor pushes each request's delta into its stream. The engine's own work (and the
consumers' streaming) thus runs while the model computes, and HTTP keeps being served. Aborts
that arrive mid-step are applied right after a step returns. This class is the server's
`EngineClient`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from engine.config import EngineArgs
from engine.engine_client import EngineLoad, ModelInfo
from engine.errors import EngineDeadError, QueueFullError
from engine.input_processor import Message, PromptInput
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics, StatsLogger, StepTimes
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("kvserve")

# Allocations between young-generation collections while serving (gc's default is 700).
GC_YOUNG_THRESHOLD = 20_000


class RequestStream:
    """One request's deltas, in step order. Iterate it; `cancel()` aborts the request."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = 0
        self.finished = False
        self._engine = engine
        self._items: deque[RequestOutput | BaseException] = deque()
        # The consumer's wait for the next item (a bare future: an asyncio.Event costs several
        # times more, paid by every request every step).
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queues one step's output (or the error that ends the stream)."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        items = self._items
        while not items:
            if self.finished:
                raise StopAsyncIteration
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            await waiter
        item = items.popleft()
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
                 max_queue_len: int | None = None, stats_interval_s: float = 10.0,
                 vllm_metric_names: bool = False) -> None:
        self.engine = engine
        info = engine.describe()
        self.model_info = ModelInfo(engine.model_name(), info["root"], info["max_model_len"],
                                    info["vocab_size"], engine.default_sampling_params)
        self.max_queue_len = max_queue_len
        self.model_name = model_name or self.model_info.name  # the name metrics are labelled with
        self.metrics = EngineMetrics(engine.stats, info, self.model_name,
                                     vllm_names=vllm_metric_names)
        engine.output_processor.metrics = self.metrics
        self.step_times = StepTimes()
        self.stats_logger = StatsLogger(engine.stats, stats_interval_s, self.step_times)
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
        """Starts the step loop on the running event loop.

        First moves every object alive after startup (modules, weights' wrappers, tokenizer)
        out of the garbage collector's reach, as vLLM does: otherwise each full collection
        walks them all, a pause of a few hundred ms in the middle of streaming."""
        if self._task is None:
            gc.collect()
            gc.freeze()
            # Each step allocates a few thousand short-lived containers (rows, outputs, chunks):
            # at the default 700 a young collection ran several times a step, promoting
            # objects still in flight between steps into older generations.
            threshold = gc.get_threshold()
            if threshold[0] < GC_YOUNG_THRESHOLD:
                gc.set_threshold(GC_YOUNG_THRESHOLD, *threshold[1:])
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
        return self.engine.output_processor.num_unfinished

    @property
    def is_dead(self) -> bool:
        """Whether the step loop crashed, or a tensor-parallel rank exited."""
        return self._dead is not None or self.engine.dead_reason() is not None

    # ---- the client interface -------------------------------------------------------------

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A conversation rendered with the model's chat template, as a prompt dict."""
        return self.engine.input_processor.render_chat(messages, add_generation_prompt,
                                                       tools=tools)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text."""
        return self.engine.input_processor.encode(text, add_special_tokens)

    def detokenize(self, token_ids: list[int], param: str = "tokens") -> str:
        """Text of token ids (InvalidRequestError naming `param` for ids outside the vocab)."""
        return self.engine.input_processor.decode(token_ids, param)

    def metrics_text(self) -> bytes:
        """The Prometheus exposition of this engine's metrics."""
        return self.metrics.render()

    def load(self) -> EngineLoad:
        """Running and waiting requests and the KV token slots they hold."""
        kv, scheduler = self.engine.kv, self.engine.scheduler
        held = self.engine.num_blocks - kv.num_free_blocks
        return EngineLoad(len(scheduler.running), len(scheduler.waiting),
                          held * kv.block_size, self.engine.num_blocks * kv.block_size,
                          kv.usage())

    def server_info(self) -> dict[str, Any]:
        """The engine's settings as plain JSON values (GET /server_info)."""
        engine, info = self.engine, self.engine.describe()
        return {"model_name": self.model_name, "model_path": info["root"],
                "architecture": engine.model_config.architecture,
                "max_model_len": info["max_model_len"], "vocab_size": info["vocab_size"],
                "dtype": str(engine.runner.dtype).removeprefix("torch."),
                "device": str(engine.runner.device),
                "block_size": info["block_size"], "num_gpu_blocks": info["num_gpu_blocks"],
                "num_kv_cache_tokens": info["num_kv_cache_tokens"],
                "cache_dtype": info["cache_dtype"],
                "enable_prefix_caching": info["enable_prefix_caching"],
                "max_num_seqs": engine.args.max_num_seqs,
                "tensor_parallel_size": engine.args.tensor_parallel_size,
                "max_num_batched_tokens": engine.max_num_batched_tokens,
                "max_queue_len": self.max_queue_len}

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix, only while no request is waiting or running (as
        SGLang's flush_cache); returns whether it did. Runs on the event-loop thread, where the
        scheduler runs, so no step can be admitting a request meanwhile."""
        if self.engine.has_unfinished_requests() or self._step_in_flight:
            return False
        done = self.engine.kv.reset_prefix_cache()
        if done:
            logger.info("prefix cache reset: every cached block forgotten")
        return done

    def add_request(self, prompt: PromptInput, params: SamplingParams,
                    request_id: str) -> RequestStream:
        """Validates and queues a request whose outputs are per-step deltas; raises
        InvalidRequestError, QueueFullError or EngineDeadError before anything is streamed."""
        if self.is_dead:
            raise EngineDeadError("the engine stopped after an internal error: "
                                  f"{self._dead or self.engine.dead_reason()}")
        if self.max_queue_len is not None and \
                len(self.engine.scheduler.waiting) >= self.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue_len} requests); "
                                 "retry later")
        stream = RequestStream(request_id, self)
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        parent = self.engine.add_requests([(request_id, prompt, params)], stream)[0]
        stream.num_prompt_tokens = len(parent.prompt_token_ids)
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
            self.engine.abort_request(request_id)

    def abort_all(self, reason: str) -> None:
        """Ends every unfinished request's stream with EngineDeadError(reason) and aborts it
        (a drain that ran out of time): consumers see the error instead of a cut connection."""
        for stream in self.engine.output_processor.streams():
            stream.put(EngineDeadError(reason))
            if isinstance(stream, RequestStream):
                stream.cancel()

    # ---- the step loop --------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests() and not self.engine.in_flight:
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
            for stream in self.engine.output_processor.drop_all():
                stream.put(EngineDeadError(f"the engine stopped after an internal error: {exc}"))

    async def _step(self) -> None:
        engine = self.engine
        if len(engine.in_flight) < engine.pipeline_depth():
            scheduled = engine.schedule_step()
            if scheduled is not None:
                self.metrics.iteration_tokens.observe(scheduled.batch.num_tokens)
                self._step_in_flight = True
                if len(engine.in_flight) < engine.pipeline_depth():
                    return  # schedule the next step while this one runs
            elif not engine.in_flight:
                await asyncio.sleep(0.001)  # nothing admissible yet (a sibling or grammar waits)
                return
        step = engine.in_flight.popleft()
        waited = time.perf_counter()
        try:
            result, forward_s = await asyncio.wrap_future(engine.result_of(step))
            returned = time.perf_counter()
            engine.apply(step.batch, result)
        except Exception:
            logger.exception("a model step failed; its requests end with finish_reason=error")
            forward_s, returned = 0.0, time.perf_counter()
            engine.fail(step.batch)
            if engine.dead_reason() is not None:  # no step can run again: fail the rest, stop
                raise EngineDeadError(str(engine.dead_reason())) from None
        finally:
            self._step_in_flight = bool(engine.in_flight)
        self.num_steps += 1
        pending, self._pending_aborts = self._pending_aborts, []
        for request_id in pending:
            engine.abort_request(request_id)
        # Hand-off: the wait for the worker beyond its forward (none when it overlapped).
        self.step_times.add(step.schedule_s, forward_s, max(0.0, returned - waited - forward_s),
                            time.perf_counter() - returned)
