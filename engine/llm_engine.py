"""The engine: input processing -> scheduler -> worker -> output processing, one step at a time.

`step()` serves the offline API; the async engine drives the same `schedule()` / `apply()`
around its own await of the worker. Everything here runs on the caller's (event-loop) thread
except the model, which runs on the worker thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
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
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.parallel_sampling import ParentRequest
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput, StepResult
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
from engine.output_processor import OutputProcessor, OutputStream
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
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
        runner = ModelRunner(self.source, args, device, args.resolved_dtype(device),
                             self.max_model_len)
        self.kv_cache_plan = self._init_kv_cache(runner)
        self.runner = runner  # the worker thread's; read it here only between steps
        self.worker = Worker(runner)
        self.kv = KVCacheManager(self.kv_cache_plan.num_blocks, args.block_size,
                                 args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len)
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

    def _init_kv_cache(self, runner: ModelRunner) -> KVCachePlan:
        peak = runner.profile_peak_activation_bytes(self.max_num_batched_tokens)
        peak += runner.profile_cuda_graph_bytes(self.args.max_num_seqs)
        plan = plan_kv_cache(self.model_config, self.args, runner.device, runner.dtype,
                             runner.weight_bytes(), peak, self.max_model_len)
        for line in capacity_log_lines(plan, runner.device, self.max_model_len):
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

    def wait_for_grammars(self, timeout: float) -> None:
        """Blocks until a waiting request's grammar is compiled, or `timeout` seconds."""
        pending = [r.grammar for r in self.scheduler.waiting_for_grammar()
                   if r.grammar is not None]
        if pending:
            concurrent.futures.wait(pending, timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def apply(self, batch: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Applies a step's result: tokens and stop checks, then the outputs."""
        touched = self.scheduler.update_from_output(batch, result.sampled, result.logprobs,
                                                    result.grammar_terminated,
                                                    result.grammar_rejected)
        return self.output_processor.process(touched, time.monotonic())

    def fail(self, batch: SchedulerOutput) -> list[RequestOutput]:
        """Ends every request of a step that raised, with finish_reason `error`."""
        failed: list[Request] = self.scheduler.fail_requests(r.request_id for r in batch.requests)
        return self.output_processor.finish_without_token(failed, time.monotonic())

    def step(self) -> list[RequestOutput]:
        """One synchronous step: schedule, run on the worker thread, apply."""
        batch = self.schedule()
        failed, self._failed_outputs = self._failed_outputs, []
        if not batch.requests and not batch.finished_request_ids:
            self.wait_for_grammars(0.05)  # nothing admissible: a grammar may be compiling
            return failed
        result, self.last_step_seconds = self.worker.submit(batch).result()
        return failed + self.apply(batch, result)

    def shutdown(self) -> None:
        """Stops the worker and grammar-compile threads."""
        self.worker.shutdown()
        self.structured_output.shutdown()

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
                "enable_prefix_caching": args.enable_prefix_caching}
