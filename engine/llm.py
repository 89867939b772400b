"""The offline API: `LLM(model).generate(prompts, sampling_params)` and `LLM.chat(...)`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm

from engine.config import EngineArgs
from engine.input_processor import Message, PromptInput
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Batch generation over the whole engine, as vLLM's `LLM` class.

    `LLM()` with no model serves the embedded SmolLM2-135M-Instruct GGUF.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs.from_kwargs(model, **engine_args))

    def get_tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the generation config's defaults (--generation-config)."""
        return SamplingParams(**self.engine.default_sampling_params)

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt; returns outputs in prompt order.

        Every prompt is validated before any is queued, so one bad prompt fails the call
        without leaving the others half-run.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:  # the generation config's defaults, as vLLM's LLM
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompt_list))
        parents = self.engine.add_requests([(None, p, sp) for p, sp in zip(
            prompt_list, params, strict=True)])
        return self._run([parent.request_id for parent in parents], use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = ([messages] if messages and isinstance(messages[0], dict)
                         else messages)
        prompts: list[PromptInput] = [
            self.engine.input_processor.render_chat(cast(list[Message], conversation),
                                                   add_generation_prompt, chat_template)
            for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        order = {rid: i for i, rid in enumerate(request_ids)}
        results: list[RequestOutput | None] = [None] * len(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        start = time.perf_counter()
        before = engine.stats()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)
            if use_tqdm:
                elapsed, now = max(time.perf_counter() - start, 1e-9), engine.stats()
                prefill = (now.num_prompt_tokens - before.num_prompt_tokens) / elapsed
                decode = (now.num_generation_tokens - before.num_generation_tokens) / elapsed
                bar.set_postfix_str(f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s",
                                    refresh=False)
        bar.close()
        return [r for r in results if r is not None]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int)
                                                               for t in prompts):
        return [list(prompts)]  # a single prompt given as token ids
    if not prompts:
        raise ValueError("no prompts given")
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int
                    ) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
