"""The offline benchmark's workloads: kvserve (throughput, timed decode steps and their
profile, batch 1) and transformers (batch 1, one-at-a-time generate, generate_batch)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from engine import LLM, SamplingParams
from loadtest.bench_config import BenchConfig
from loadtest.bench_machine import timed

# ---- kvserve ------------------------------------------------------------------------------


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, fixed-length sampling params (EOS ignored)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def kvserve_engine(dtype: str, threads: int) -> LLM:
    """kvserve on the embedded GGUF, warmed up with one short request."""
    llm = LLM(dtype=dtype, num_threads=threads)
    llm.generate([{"prompt_token_ids": [100] * 16}], greedy(16), use_tqdm=False)
    return llm


def kvserve_throughput(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Output tokens/s of one `LLM.generate` call over all prompts."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(output_len),
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompts": len(prompts), "seconds": seconds, "output_tokens": tokens,
            "tokens_per_s": tokens / seconds}


def _all_decoding(llm: LLM, num_seqs: int) -> bool:
    """Whether exactly `num_seqs` requests run and each has one token left to compute."""
    sched = llm.engine.scheduler
    return (len(sched.running) == num_seqs and not sched.waiting and
            all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running))


def _profile_steps(llm: LLM, num_steps: int) -> str:
    """torch.profiler's top ops over `num_steps` steps run inline (schedule, execute, apply)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            batch = engine.schedule()
            engine.apply(batch, engine.execute(batch))
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def kvserve_decode(llm: LLM, prompts: list[list[int]], num_steps: int, profile: bool
                   ) -> dict[str, Any]:
    """Drives `engine.step()` and times the steps where every prompt decodes one token."""
    engine = llm.engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, greedy(num_steps + 8))
           for p in prompts]
    while not _all_decoding(llm, len(prompts)):
        engine.step()
    steps, workers, contexts = [], [], []
    for _ in range(num_steps):
        contexts.append(statistics.fmean(r.num_tokens for r in engine.scheduler.running))
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        workers.append(engine.last_step_seconds)
    table = _profile_steps(llm, 4) if profile else None
    for rid in ids:
        engine.abort_request(rid)
    step = statistics.median(steps)
    return {"num_seqs": len(prompts), "steps": num_steps, "median_step_s": step,
            "median_worker_s": statistics.median(workers), "mean_context": statistics.fmean(
                contexts), "tokens_per_s": len(prompts) / step, "profile": table}


def kvserve_batch1(llm: LLM, prompt: list[int], num_tokens: int) -> dict[str, Any]:
    """Tokens/s of one greedy request of `num_tokens` from a short prompt (prefill included)."""
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(num_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = len(out[0].outputs[0].token_ids)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def run_kvserve(cfg: BenchConfig, dtype: str, prompts: list[list[int]] | None,
                decode_prompts: list[list[int]], batch1_prompt: list[int]) -> dict[str, Any]:
    """All kvserve measurements for one dtype; `prompts=None` skips the throughput run."""
    llm = kvserve_engine(dtype, cfg.threads)
    wait = cfg.wait_quiet
    result: dict[str, Any] = {"dtype": dtype, "weight_bytes": llm.engine.runner.weight_bytes()}
    if prompts is not None:
        result["throughput"] = timed(lambda: kvserve_throughput(llm, prompts, cfg.output_len),
                                     wait)
    result["decode"] = timed(lambda: kvserve_decode(llm, decode_prompts, cfg.decode_steps,
                                                    cfg.profile_decode), wait)
    result["batch1"] = timed(lambda: kvserve_batch1(llm, batch1_prompt, cfg.batch1_tokens), wait)
    llm.engine.shutdown()
    return result


# ---- transformers -------------------------------------------------------------------------


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
    result = {"batch1": timed(lambda: hf_batch1(model, batch1_prompt, cfg.batch1_tokens), wait)}
    if not cfg.skip_hf_sequential:
        head = prompts[:cfg.hf_sequential_prompts]
        result["sequential"] = timed(lambda: hf_sequential(model, head, out_len), wait)
    result["generate_batch"] = timed(lambda: hf_generate_batch(model, prompts, out_len, cfg),
                                     wait)
    return result
