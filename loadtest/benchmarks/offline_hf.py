"""The offline benchmark's transformers side, on the same GGUF dequantized to float32: batch-1
`generate`, one-at-a-time `generate`, and continuous batching (`generate_batch`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from loadtest.benchmarks.machine import median_run, timed

if TYPE_CHECKING:
    from loadtest.benchmarks.offline_config import BenchConfig


def load_hf_model() -> Any:
    """transformers' LlamaForCausalLM on the same GGUF, dequantized to float32."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from engine.model_loader.gguf.weights import default_model_path

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


def hf_generate_one(model: Any, prompt: list[int], num_tokens: int) -> int:
    """One greedy `generate` of exactly `num_tokens` (min = max so EOS cannot stop it)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                              do_sample=False, pad_token_id=0, eos_token_id=2)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return int(out.shape[1] - ids.shape[1])


def hf_sequential(model: Any, prompts: list[list[int]], num_tokens: int) -> dict[str, Any]:
    """Tokens/s of `generate` over the prompts one at a time."""
    start = time.perf_counter()
    tokens = sum(hf_generate_one(model, p, num_tokens) for p in prompts)
    seconds = time.perf_counter() - start
    return {"prompts": len(prompts), "seconds": seconds, "output_tokens": tokens,
            "tokens_per_s": tokens / seconds}


def hf_generate_batch(model: Any, prompts: list[list[int]], num_tokens: int,
                      cfg: BenchConfig) -> dict[str, Any]:
    """Tokens/s of transformers' continuous batching (`generate_batch`), EOS disabled.

    The cache holds every request at once (as kvserve's does); page size and batch-token cap
    come from the flags (256 / 512 by default: a sweep of 32-256 pages and 256-2048 tokens
    moved its speed by under 30% on 2 cores).
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = cfg.hf_page_size
    blocks = sum(-(-(len(p) + num_tokens) // page) for p in prompts)
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                  max_batch_tokens=cfg.hf_max_batch_tokens,
                                  max_requests_per_batch=len(prompts))
    gen = GenerationConfig(max_new_tokens=num_tokens, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=gen,
                                continuous_batching_config=cb)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"prompts": len(prompts), "seconds": seconds, "output_tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "settings": f"page_size={page} num_blocks={blocks} max_batch_tokens="
                        f"{cfg.hf_max_batch_tokens} max_requests_per_batch={len(prompts)}"}


def hf_batch1(model: Any, prompt: list[int], num_tokens: int) -> dict[str, Any]:
    """Tokens/s of one `generate` of `num_tokens` (prefill included)."""
    start = time.perf_counter()
    tokens = hf_generate_one(model, prompt, num_tokens)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def run_hf(cfg: BenchConfig, prompts: list[list[int]], batch1_prompt: list[int]
           ) -> dict[str, Any]:
    """transformers' batch-1 generate, one-at-a-time generate, and generate_batch."""
    model = load_hf_model()
    hf_generate_one(model, [100] * 16, 16)  # warm-up
    wait, out_len = cfg.wait_quiet, cfg.output_len
    result = {"batch1": timed(lambda: median_run(
        lambda: hf_batch1(model, batch1_prompt, cfg.batch1_tokens), cfg.batch1_repeats), wait)}
    if not cfg.skip_hf_sequential:
        head = prompts[:cfg.hf_sequential_prompts]
        result["sequential"] = timed(lambda: hf_sequential(model, head, out_len), wait)
    result["generate_batch"] = timed(lambda: hf_generate_batch(model, prompts, out_len, cfg),
                                     wait)
    return result
