"""The engine: validates and queues requests, runs schedule -> worker step -> apply, and
reports outputs. The synchronous `step()` serves the offline API; the async front reuses
`schedule()` / `apply()` around its own await of the worker."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engine.capacity import (
    capacity_log_lines,
    check_max_model_len_fits,
    plan_kv_cache,
    resolve_max_model_len,
)
from engine.config import EngineArgs
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput, StepResult
from engine.model_loader.loader import checkpoint_generation_config, load_tokenizer, resolve_model
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger("kvserve")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
PromptInput = str | list[int] | dict[str, Any]


class LLMEngine:
    """Owns the scheduler, the output processor and the worker thread running the model."""

    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        torch.manual_seed(args.seed)
        self.source = resolve_model(args.model)
        self.model_config = self.source.config
        self.device = args.resolved_device()
        self.dtype = args.resolved_dtype(self.device)
        self.tokenizer = load_tokenizer(self.source, args.tokenizer)
        self.max_model_len = resolve_max_model_len(self.model_config, args)
        self.max_num_batched_tokens = args.max_num_batched_tokens or max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, min(self.max_model_len, 8192))
        self.runner = ModelRunner(self.source, args, self.device, self.dtype, self.max_model_len)
        self.num_blocks = self._init_kv_cache()
        self.kv = KVCacheManager(self.num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_ids = self._eos_token_ids()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-worker")
        self._next_id = 0

    def _init_kv_cache(self) -> int:
        peak = self.runner.profile_peak_activation_bytes(self.max_num_batched_tokens)
        peak += self.runner.profile_cuda_graph_bytes(self.args.max_num_seqs)
        plan = plan_kv_cache(self.model_config, self.args, self.device, self.dtype,
                             self.runner.weight_bytes(), peak, self.max_model_len)
        for line in capacity_log_lines(plan, self.device, self.max_model_len):
            logger.info(line)
        check_max_model_len_fits(plan, self.max_model_len, self.device)
        self.runner.allocate_kv_cache(plan.num_blocks)
        self.runner.init_cuda_graphs(self.args.max_num_seqs)
        self.kv_cache_plan = plan
        return plan.num_blocks

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_eos = checkpoint_generation_config(self.source).get("eos_token_id")
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(int(i) for i in ids)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptInput,
                    params: SamplingParams | None = None) -> str:
        """Validates and queues a request; raises ValueError with what to change."""
        params = params or SamplingParams()
        text, prompt_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(len(prompt_ids), params)
        request_id = request_id if request_id is not None else self._new_id()
        if request_id in self.outputs.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        choices = self._make_choices(request_id, prompt_ids, params, max_tokens)
        self.outputs.add_group(request_id, text, choices)
        for choice in choices:
            self.scheduler.add_request(choice)
        return request_id

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> dict[str, Any]:
        """Renders a conversation with the model's chat template into a prompt dict."""
        if not messages:
            raise ValueError("a conversation needs at least one message")
        try:
            text = str(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                chat_template=chat_template))
        except Exception as exc:  # jinja errors, missing template
            raise ValueError(f"the chat template could not render these messages: {exc}") from exc
        # The template already wrote BOS and role markers as text.
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return {"prompt": text, "prompt_token_ids": ids}

    def _new_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def _make_choices(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      max_tokens: int) -> list[Request]:
        choices: list[Request] = []
        for i in range(params.n):
            child_params = params
            if params.seed is not None and i > 0:  # n seeded choices must differ from each other
                seed = (params.seed + i + 2**63) % 2**64 - 2**63  # stays a 64-bit seed
                child_params = SamplingParams(**{**params.__dict__, "seed": seed})
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            choices.append(Request(rid, prompt_ids, child_params, self.eos_token_ids, max_tokens,
                                   parent=choices[0] if choices else None, choice_index=i))
        return choices

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one token of text")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return None, self.check_token_ids(list(prompt))
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, not "
                         f"{type(prompt).__name__}")

    def check_token_ids(self, ids: list[Any]) -> list[int]:
        """The ids as ints; ValueError for an empty list or an id outside the vocabulary
        (before anything decodes or embeds them)."""
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise ValueError(f"token id {token!r} is outside the vocabulary [0, {vocab})")
        return [int(t) for t in ids]

    def _check_lengths(self, num_prompt: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise ValueError(f"the prompt has {num_prompt} tokens, but max_model_len is {limit}: "
                             "shorten the prompt or raise --max-model-len")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                             f"{num_prompt + max_tokens} exceeds max_model_len ({limit}); lower "
                             "max_tokens or shorten the prompt")
        # Startup makes max_model_len fit the cache, so this holds already; it stays as the
        # guard against queueing a request that could never be scheduled (it would wait forever).
        total, block_size = num_prompt + max_tokens, self.args.block_size
        needed_blocks = -(-total // block_size)
        if needed_blocks > self.num_blocks:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} "
                             f"tokens need {needed_blocks} KV blocks, but the whole KV cache holds "
                             f"{self.num_blocks} blocks ({self.num_blocks * block_size} tokens); "
                             "lower max_tokens, shorten the prompt or give the cache more memory")
        return max_tokens

    def abort_request(self, request_id: str) -> None:
        """Stops a request (all its choices) and frees its blocks now."""
        choices = self.outputs.choices_of(request_id)
        self.scheduler.abort_requests(c.request_id for c in choices)
        self.outputs.make_outputs(choices)

    def has_unfinished_requests(self) -> bool:
        """Whether anything is waiting or running."""
        return self.scheduler.has_unfinished()

    # ---- stepping -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks this step's batch (event-loop thread)."""
        return self.scheduler.schedule()

    def execute(self, batch: SchedulerOutput) -> StepResult:
        """Runs a batch on the model (call from the worker thread)."""
        return self.runner.execute(batch)

    def apply(self, batch: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Applies a step's result: tokens, stop checks, outputs (event-loop thread)."""
        touched = self.scheduler.update_from_output(batch, result.sampled, result.logprobs)
        for request, stop in self.outputs.process_tokens(touched):
            request.stop_reason = stop
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        return self.outputs.make_outputs(touched)

    def fail(self, batch: SchedulerOutput) -> list[RequestOutput]:
        """Ends every request of a step that raised, with finish_reason `error`."""
        failed = self.scheduler.fail_requests(r.request_id for r in batch.requests)
        return self.outputs.make_outputs(failed)

    def step(self) -> list[RequestOutput]:
        """One synchronous step: schedule, run on the worker thread, apply."""
        batch = self.schedule()
        if not batch.requests and not batch.finished_request_ids:
            return []
        started = time.perf_counter()
        result = self.worker.submit(self.execute, batch).result()
        self.last_step_seconds = time.perf_counter() - started
        return self.apply(batch, result)

    def shutdown(self) -> None:
        """Stops the worker thread."""
        self.worker.shutdown(wait=True)
