"""The offline benchmark's measurements: the workloads, the machine rates and kvserve's runs
(throughput, timed decode steps and their profile, batch 1); transformers' runs are in
`offline_hf`, the options in `offline_config`. `run(cfg)` measures everything in one go."""

from __future__ import annotations

import concurrent.futures
import gc
import statistics
import time
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from loadtest.benchmarks.common import random_prompts, spread_lengths
from loadtest.benchmarks.machine import (
    GIB,
    environment,
    matmul_gflops,
    matmul_rates,
    median_run,
    read_bandwidth_gbs,
    timed,
)
from loadtest.benchmarks.offline_config import BenchConfig
from loadtest.benchmarks.offline_hf import run_hf
from loadtest.benchmarks.offline_report import build_report

# ---- kvserve ------------------------------------------------------------------------------


MAX_SETUP_STEPS = 100_000  # steps to bring every prompt to decoding before giving up


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
    """Whether exactly `num_seqs` requests run, each past its prompt with at most one token left
    to compute (none while async scheduling has its next token in flight)."""
    sched = llm.engine.scheduler
    return (len(sched.running) == num_seqs and not sched.waiting and
            all(r.num_computed_tokens >= r.num_prompt_tokens and
                r.num_tokens - r.num_computed_tokens <= 1 for r in sched.running))


def _profile_steps(llm: LLM, num_steps: int) -> str:
    """torch.profiler's top ops over `num_steps` steps; the profiler runs on the worker thread,
    where the model runs (a forward on this thread would start a second OpenMP team and slow
    every later step: engine/worker/worker.py)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    prof = profile(activities=[ProfilerActivity.CPU])
    engine.worker.call(prof.start)
    for _ in range(num_steps):
        batch = engine.schedule()
        engine.apply(batch, engine.worker.submit(batch).result()[0])
    engine.worker.call(prof.stop)
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def kvserve_decode(llm: LLM, prompts: list[list[int]], num_steps: int, profile: bool
                   ) -> dict[str, Any]:
    """Drives `engine.step()` and times the steps where every prompt decodes one token."""
    engine = llm.engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, greedy(num_steps + 8))
           for p in prompts]
    for _ in range(MAX_SETUP_STEPS):
        if _all_decoding(llm, len(prompts)):
            break
        engine.step()
    else:
        raise RuntimeError(f"the {len(prompts)} prompts never all reached decoding")
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


def engine_arithmetic(llm: LLM) -> dict[str, str]:
    """What the engine's decoder multiplies in: int8 for layers on kvserve's tiled quantized
    kernels, else the linear layers' compute dtype; attention in the KV cache's dtype."""
    from engine.quantization import QuantizedLinear

    runner = llm.engine.runner
    first: Any = runner.model.layers[0]
    layer = first.mlp.gate_up_proj
    if isinstance(layer, QuantizedLinear):
        linear = ("int8" if "layout_tiles" in layer.tensors()
                  else str(layer.method.plan.compute_dtype).removeprefix("torch."))
    else:
        linear = str(first.input_layernorm.weight.dtype).removeprefix("torch.")
    # the CPU attention kernels multiply a bf16 cache in bf16 and every other cache in float32
    return {"linear": linear,
            "attention": "bfloat16" if runner.kv_cache_dtype() == torch.bfloat16 else "float32"}


def run_kvserve(cfg: BenchConfig, dtype: str, prompts: list[list[int]] | None,
                decode_prompts: list[list[int]], batch1_prompt: list[int]) -> dict[str, Any]:
    """All kvserve measurements for one dtype; `prompts=None` skips the throughput run."""
    llm = kvserve_engine(dtype, cfg.threads)
    wait = cfg.wait_quiet
    runner = llm.engine.runner
    # the dtype `auto` resolved to
    result: dict[str, Any] = {"dtype": str(runner.dtype).removeprefix("torch."),
                              "weight_bytes": runner.weight_bytes(),
                              "arithmetic": engine_arithmetic(llm),
                              "kv_element_bytes": runner.kv_cache_dtype().itemsize}
    if prompts is not None:
        result["throughput"] = timed(lambda: kvserve_throughput(llm, prompts, cfg.output_len),
                                     wait)
    result["decode"] = timed(lambda: kvserve_decode(llm, decode_prompts, cfg.decode_steps,
                                                    cfg.profile_decode), wait)
    result["batch1"] = timed(lambda: median_run(
        lambda: kvserve_batch1(llm, batch1_prompt, cfg.batch1_tokens), cfg.batch1_repeats), wait)
    llm.engine.shutdown()
    return result


# ---- the run ------------------------------------------------------------------------------


def measure_machine(cfg: BenchConfig, hidden: int, intermediate: int) -> dict[str, Any]:
    """Peak matmul rate (large square GEMM), a decode-shaped GEMM, and read bandwidth."""
    size, rows = cfg.gemm_size, cfg.decode_seqs

    def measure() -> dict[str, Any]:
        """The rates, timed together."""
        return {"gemm_square_gflops": matmul_gflops(size, size, size),
                "gemm_decode_gflops": matmul_gflops(rows, hidden, 2 * intermediate, repeats=50),
                "gemm_square_by_arithmetic": matmul_rates(size),
                "gemm_square_shape": f"[{size}x{size}] @ [{size}x{size}]",
                "gemm_decode_shape": f"[{rows}x{hidden}] @ [{hidden}x{2 * intermediate}]",
                **read_bandwidth_gbs(cfg.bandwidth_bytes),
                "bandwidth_method": f"float32 tensor of {cfg.bandwidth_bytes / GIB:.2f} GiB: "
                                    f".sum() (read once), best of 5, {cfg.threads} threads"}
    return timed(measure, cfg.wait_quiet)


def make_workloads(cfg: BenchConfig, mc: ModelConfig) -> dict[str, Any]:
    """The throughput prompts, the short decode prompts and the batch-1 prompt."""
    from engine.model_loader.gguf.tokenizer import load_gguf_tokenizer
    from engine.model_loader.gguf.weights import default_model_path

    tok = load_gguf_tokenizer(default_model_path())
    excluded = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    lengths = spread_lengths(cfg.num_prompts, cfg.min_input, cfg.max_input, cfg.seed)
    decode = random_prompts([cfg.decode_input] * cfg.decode_seqs, mc.vocab_size, excluded,
                            cfg.seed + 1)
    return {"prompts": random_prompts(lengths, mc.vocab_size, excluded, cfg.seed),
            "decode": decode, "batch1": random_prompts([16], mc.vocab_size, excluded,
                                                       cfg.seed + 2)[0]}


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Measures everything in order: machine, kvserve (dtype, then bf16), transformers."""
    from engine.model_loader.gguf.weights import default_model_path, read_gguf_config

    torch.set_num_threads(cfg.threads)
    mc = read_gguf_config(default_model_path())
    work = make_workloads(cfg, mc)
    env = environment(cfg.threads, "python -m loadtest.benchmarks.offline")
    print(f"threads={cfg.threads} torch={env['torch']} cpu={env['cpu']}", flush=True)
    # On a thread that then exits (its OpenMP team with it): a team left on this thread would
    # halve the speed of the kvserve engine's worker thread (engine/worker/worker.py).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        rates = pool.submit(measure_machine, cfg, mc.hidden_size, mc.intermediate_size).result()
    kv = run_kvserve(cfg, cfg.dtype, work["prompts"], work["decode"], work["batch1"])
    gc.collect()
    bf16 = None
    if not cfg.skip_bf16 and cfg.dtype != "bfloat16":
        bf16 = run_kvserve(cfg, "bfloat16", None, work["decode"], work["batch1"])
        gc.collect()
    hf = run_hf(cfg, work["prompts"], work["batch1"])
    return build_report(cfg, env, mc, rates, kv, bf16, hf)
