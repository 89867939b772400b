"""The engine: input processing -> scheduler -> worker -> output processing, one step at a time.

`step()` serves the offline API; the async engine drives the same `schedule()` / `apply()`
around its own await of the worker. Everything here runs on the caller's (event-loop) thread
except the model, which runs on the worker thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from engine.capacity import (
    KVCachePlan,
    capacity_log_lines,
    check_max_model_len_fits,
    plan_kv_cache,
    resolve_max_model_len,
    resolve_max_num_batched_tokens,
)
from engine.config import EngineArgs
from engine.core.async_scheduler import AsyncScheduler, BatchQueueScheduler
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.parallel_sampling import ParentRequest
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput, StepResult
from engine.distributed.launcher import ParallelLauncher, start_parallel
from engine.distributed.parallel_state import rank_model_config
from engine.errors import InvalidRequestError
from engine.generation_config import (
    default_sampling_params,
    parse_override,
    read_generation_config,
)
from engine.input_processor import InputProcessor, PromptInput
from engine.model_loader.loader import (
    checkpoint_generation_config,
    load_tokenizer,
    resolve_model,
)
from engine.models.pipeline_layers import stage_kv_config
from engine.output_processor import OutputProcessor, OutputStream
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.step_profile import build_step_budget
from engine.structured_output import StructuredOutputManager, constraint_key
from engine.worker.model_runner import ModelRunner
from engine.worker.worker import Worker

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class EngineStats:
    """The live counters and gauges, read at once (the stats line and /metrics)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens over queried tokens."""
        return self.prefix_cache_hits / self.prefix_cache_queries \
            if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class InFlightStep:
    """A step handed to the worker and not yet applied: its batch, the worker's future of
    (result, forward seconds) or, under the pipeline's batch queue, of its launch (`result_of`
    gives the result either way), and the seconds scheduling it took."""

    batch: SchedulerOutput
    future: concurrent.futures.Future[Any]
    schedule_s: float


class LLMEngine:
    """Owns the input processor, scheduler, output processor and the worker."""

    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        torch.manual_seed(args.seed)
        self.source = resolve_model(args.model)
        self.model_config = self.source.config
        device = args.resolved_device()
        self.tokenizer = load_tokenizer(self.source, args.tokenizer)
        self.max_model_len = resolve_max_model_len(self.model_config, args)
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(args, self.max_model_len)
        # --tensor-parallel-size T x --pipeline-parallel-size P: ranks 1..T x P - 1 are spawned
        # here; this process is rank 0 (tensor rank 0 of the last stage).
        self.ranks = start_parallel(args, self.model_config, self.max_model_len, device)
        # The model's thread first: loading and profiling run on it as the steps will (see
        # engine/worker/worker.py on why one thread must do all of the torch work). With TP or
        # PP, rank 0 computes there with its share of the threads, as each spawned rank does.
        ranks = self.ranks
        self.worker = Worker(ranks.num_threads if ranks is not None else args.num_threads)
        try:
            runner = self.worker.call(self._build_runner, device)
            # Without --max-num-batched-tokens the budget adapts to measured step costs.
            self.step_budget = self.worker.call(
                build_step_budget, args, runner, self.kv_cache_plan.num_blocks,
                self.max_model_len, self.max_num_batched_tokens)
        except BaseException:
            if self.ranks is not None:
                self.ranks.shutdown()
            self.worker.shutdown()
            raise
        self.runner = runner  # the worker thread's; read it here only between steps
        self.worker.attach(runner)
        self.kv = KVCacheManager(self.kv_cache_plan.num_blocks, args.block_size,
                                 args.enable_prefix_caching)
        # Pipeline stages on their own ranks: a batch per stage in flight at once.
        self.batch_queue = args.async_scheduling and args.pipeline_parallel_size > 1
        scheduler_cls = AsyncScheduler if args.async_scheduling else Scheduler
        sizes = (self.kv, args.max_num_seqs, self.max_num_batched_tokens, self.max_model_len)
        self.scheduler = BatchQueueScheduler(
            *sizes, step_budget=self.step_budget, num_stages=args.pipeline_parallel_size) \
            if self.batch_queue else scheduler_cls(*sizes, step_budget=self.step_budget)
        # Steps on the worker not yet applied, oldest first: at most pipeline_depth().
        self.in_flight: deque[InFlightStep] = deque()
        self._unsent_finished: frozenset[str] = frozenset()  # for the next step's batch
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config.vocab_size, self.max_model_len, args.block_size,
            self.kv_cache_plan.num_blocks, self._eos_token_ids())
        # Request defaults for unset fields (the server's and LLM's): --generation-config.
        self.default_sampling_params = default_sampling_params(
            read_generation_config(args.generation_config,
                                   checkpoint_generation_config(self.source)),
            parse_override(args.override_generation_config))
        self.output_processor = OutputProcessor(
            self.tokenizer, lambda r: self.scheduler.finish(r, RequestStatus.FINISHED_STOPPED))
        # Structured outputs: grammars compiled on their own thread, cached by constraint.
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.input_processor.eos_token_ids)
        self._failed_outputs: list[RequestOutput] = []  # the last schedule()'s, for step()
        self._next_id = 0
        self.last_step_seconds = 0.0  # the model's time in the last step() (benchmarks)

    def _build_runner(self, device: torch.device) -> ModelRunner:
        """Loads the model and sizes and allocates the KV cache (on the worker thread)."""
        args = self.args
        ranks = self.ranks
        runner = ModelRunner(self.source, args, device, args.resolved_dtype(device),
                             self.max_model_len, None if ranks is None else ranks.groups,
                             None if ranks is None else ranks.stage)
        if ranks is not None:
            ranks.attach(runner.model)
        self.kv_cache_plan = self._init_kv_cache(runner)
        return runner

    def _init_kv_cache(self, runner: ModelRunner) -> KVCachePlan:
        peak = runner.profile_peak_activation_bytes(self.max_num_batched_tokens)
        peak += runner.profile_cuda_graph_bytes(self.args.max_num_seqs)
        tp = self.args.tensor_parallel_size  # the plan is per rank: its share of the KV heads
        pp = self.args.pipeline_parallel_size  # per stage: the largest stage's layers
        plan = plan_kv_cache(stage_kv_config(rank_model_config(self.model_config, tp), pp),
                             self.args, runner.device, runner.dtype, runner.weight_bytes(), peak,
                             self.max_model_len)
        for line in capacity_log_lines(plan, runner.device, self.max_model_len, tp, pp,
                                       weight_bytes=runner.weight_bytes(),
                                       offloaded_bytes=runner.offloaded_bytes()):
            logger.info(line)
        check_max_model_len_fits(plan, self.max_model_len, runner.device)
        runner.allocate_kv_cache(plan.num_blocks)
        runner.init_cuda_graphs(self.args.max_num_seqs)
        return plan

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_eos = checkpoint_generation_config(self.source).get("eos_token_id")
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(int(i) for i in ids)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptInput,
                    params: SamplingParams | None = None,
                    stream: OutputStream | None = None) -> str:
        """Validates and queues a request (InvalidRequestError says what to change); returns
        its id. Its outputs go to `stream` when given, else they are returned by `step()`."""
        return self.add_requests([(request_id, prompt, params)], stream)[0].request_id

    def add_requests(self, items: list[tuple[str | None, PromptInput, SamplingParams | None]],
                     stream: OutputStream | None = None) -> list[ParentRequest]:
        """Validates every request first, then queues them all: one bad prompt refuses the lot
        without leaving the others half-run."""
        parents = []
        for request_id, prompt, params in items:
            rid = request_id if request_id is not None else self._new_id()
            if rid in self.output_processor:
                raise InvalidRequestError(f"request id {rid!r} is already in use", "id")
            parents.append(self.input_processor.process(rid, prompt, params or SamplingParams()))
        for parent in parents:
            self.output_processor.add_request(parent, stream)
            constraint = parent.choices[0].sampling_params.structured_outputs
            grammar = None if constraint is None else \
                self.structured_output.submit(constraint_key(constraint))
            for choice in parent.choices:
                choice.grammar = grammar
                self.scheduler.add_request(choice)
        return parents

    def _new_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def abort_request(self, request_id: str) -> None:
        """Stops a request (all its choices) and frees its blocks now."""
        choices = self.output_processor.choices_of(request_id)
        self.scheduler.abort_requests(c.request_id for c in choices)
        self.output_processor.abort(request_id)

    @property
    def num_blocks(self) -> int:
        """KV cache blocks in all."""
        return self.kv_cache_plan.num_blocks

    def has_unfinished_requests(self) -> bool:
        """Whether anything is waiting or running."""
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """The live counters and gauges."""
        scheduler, kv = self.scheduler, self.kv
        return EngineStats(len(scheduler.running), len(scheduler.waiting), kv.usage(),
                           kv.stats.queries, kv.stats.hits, scheduler.stats.num_preemptions,
                           scheduler.stats.num_prompt_tokens,
                           scheduler.stats.num_generation_tokens)

    # ---- stepping -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks this step's batch. Requests whose grammar failed to compile end here, with
        finish_reason `error` (their outputs go to their streams, or to the next step())."""
        batch = self.scheduler.schedule()
        failed = self.scheduler.take_failed()
        self._failed_outputs = self.output_processor.finish_without_token(
            failed, time.monotonic()) if failed else []
        return batch

    def pipeline_depth(self) -> int:
        """Steps that may be in flight at once: 2 with async scheduling (the next one is
        scheduled while one runs), one per stage with the pipeline's batch queue, 1 without
        async scheduling or while a structured-output request is live."""
        scheduler = self.scheduler
        if not isinstance(scheduler, AsyncScheduler) or not scheduler.can_run_ahead():
            return 1
        return self.args.pipeline_parallel_size if self.batch_queue else 2

    def schedule_step(self) -> InFlightStep | None:
        """Schedules a step and hands it to the worker (it joins `in_flight`); None when there
        was nothing to compute."""
        started = time.perf_counter()
        batch = self.schedule()
        if self._unsent_finished:
            batch = SchedulerOutput(batch.requests,
                                    batch.finished_request_ids | self._unsent_finished)
        if not batch.requests:
            # The worker drops finished requests' generators and matchers with the next real
            # step: a step of its own would only be one more thing to run (and to fail).
            self._unsent_finished = batch.finished_request_ids
            return None
        self._unsent_finished = frozenset()
        future = self.worker.launch(batch) if self.batch_queue else self.worker.submit(batch)
        step = InFlightStep(batch, future, time.perf_counter() - started)
        self.in_flight.append(step)
        return step

    def result_of(self, step: InFlightStep) -> concurrent.futures.Future[tuple[StepResult,
                                                                            float]]:
        """The future of the oldest in-flight step's result (with the batch queue, rank 0's
        stage runs it now, after the launches queued before)."""
        if self.batch_queue:
            return self.worker.finish(step.batch, step.future)
        return step.future

    def wait_for_grammars(self, timeout: float) -> None:
        """Blocks until a waiting request's grammar is compiled, or `timeout` seconds."""
        pending = [r.grammar for r in self.scheduler.waiting_for_grammar()
                   if r.grammar is not None]
        if pending:
            concurrent.futures.wait(pending, timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def apply(self, batch: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Applies a step's result: tokens and stop checks, then the outputs."""
        if self.step_budget is not None:
            self.step_budget.observe(batch, result.forward_seconds)
        touched = self.scheduler.update_from_output(batch, result.sampled, result.logprobs,
                                                    result.grammar_terminated,
                                                    result.grammar_rejected)
        return self.output_processor.process(touched, time.monotonic())

    def fail(self, batch: SchedulerOutput) -> list[RequestOutput]:
        """Ends every request of a step that raised, with finish_reason `error`."""
        scheduler = self.scheduler
        failed: list[Request] = scheduler.fail_batch(batch) \
            if isinstance(scheduler, AsyncScheduler) else \
            scheduler.fail_requests(r.request_id for r in batch.requests)
        return self.output_processor.finish_without_token(failed, time.monotonic())

    def step(self) -> list[RequestOutput]:
        """One step's outputs: schedule, run on the worker thread, apply. With async scheduling
        the next step is scheduled and handed over before this one's result is awaited."""
        failed: list[RequestOutput] = []
        while len(self.in_flight) < self.pipeline_depth():
            step = self.schedule_step()
            failed, self._failed_outputs = failed + self._failed_outputs, []
            if step is None:
                break
        if not self.in_flight:
            self.wait_for_grammars(0.05)  # nothing admissible: a grammar may be compiling
            return failed
        step = self.in_flight.popleft()
        try:
            result, self.last_step_seconds = self.result_of(step).result()
        except Exception:
            if isinstance(self.scheduler, AsyncScheduler):  # its counters already ran ahead:
                self.fail(step.batch)  # end its requests (error) rather than leave them astray
            raise
        return failed + self.apply(step.batch, result)

    def shutdown(self) -> None:
        """Stops the worker and grammar-compile threads (and the parallel ranks)."""
        if self.batch_queue:  # launched steps the stages still work on: finish, drop them
            while self.in_flight:
                step = self.in_flight.popleft()
                try:
                    self.result_of(step).result()
                except Exception:  # a rank died: shutdown kills the rest below
                    break
        self.worker.shutdown()
        self.structured_output.shutdown()
        if self.ranks is not None:
            self.ranks.shutdown()  # reaps ranks 1..N-1

    def dead_reason(self) -> str | None:
        """Why the engine cannot run another step (a parallel rank exited), or None."""
        return None if self.ranks is None else self.ranks.dead_rank()

    @property
    def tp(self) -> ParallelLauncher | None:
        """The spawned ranks when tensor parallel (alone or with pipeline parallel)."""
        return self.ranks if self.args.tensor_parallel_size > 1 else None

    @property
    def pp(self) -> ParallelLauncher | None:
        """The spawned ranks when pipeline parallel (alone or with tensor parallel)."""
        return self.ranks if self.args.pipeline_parallel_size > 1 else None

    def model_name(self) -> str:
        """The model's own name (folder or file stem)."""
        return self.source.name

    def describe(self) -> dict[str, Any]:
        """What /v1/models and /metrics' cache_config_info report about this engine."""
        plan, args = self.kv_cache_plan, self.args
        return {"root": str(self.source.path), "max_model_len": self.max_model_len,
                "vocab_size": self.model_config.vocab_size, "block_size": args.block_size,
                "num_gpu_blocks": plan.num_blocks,
                "num_kv_cache_tokens": plan.num_blocks * args.block_size,
                "max_concurrency": plan.max_concurrency(self.max_model_len),
                "cache_dtype": args.kv_cache_dtype,
                "enable_prefix_caching": args.enable_prefix_caching,
                "cpu_offload_gb": args.cpu_offload_gb,
                "weight_bytes": self.runner.weight_bytes(),  # on the device
                "offloaded_weight_bytes": self.runner.offloaded_bytes()}
