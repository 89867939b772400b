"""fp8 KV cache quality: greedy agreement and logprob drift against `--kv-cache-dtype auto`.

Run as `python -m loadtest.bench_fp8_quality [--num-threads 2] [--max-tokens 64]`. It serves the
embedded SmolLM2-135M-Instruct (`LLM()` with no model) three times over the same chat prompts,
with kv_cache_dtype auto, fp8_e4m3 and fp8_e5m2 (per-layer scales 1.0, vLLM's default), and
prints one table row per run. A fourth run, `auto` with a bfloat16 model (weights, activations
and KV all 16-bit), is the yardstick: how far a precision change every GPU deployment accepts
already moves greedy output on this model. Nothing here asserts; docs/fp8_kv_quality.md keeps
the measured table.

Metrics, each against the auto run of the same prompt:
- prefix agreement: tokens before the first divergence / tokens auto generated. Greedy decoding
  is autoregressive, so after one flipped token the continuations differ for a benign reason;
  this is the strict number.
- overall agreement: positions holding the same token / the longer output's length.
- identical outputs: prompts whose whole completion equals auto's.
- logprob MAD: mean |logprob_fp8 - logprob_auto| of the chosen token over the common prefix
  (the same context, so the difference is the cache's rounding alone).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine import LLM, SamplingParams

# (kv_cache_dtype, model dtype); the first is the reference every other run is compared with.
RUNS = (("auto", "float32"), ("fp8_e4m3", "float32"), ("fp8_e5m2", "float32"),
        ("auto", "bfloat16"))
# The same budget for every run, so the capacity columns compare like for like.
KV_CACHE_MEMORY_BYTES = 256 * 2**20
MAX_MODEL_LEN = 2048
PROMPTS = (
    "What is the capital of France, and why is it famous?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about the ocean.",
    "Give me three tips for learning a new language.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How does a bicycle stay upright?",
    "List five fruits that are high in vitamin C.",
    "What is the difference between weather and climate?",
    "Write a short, polite email declining a meeting invitation.",
    "Why is the sky blue?",
    "Explain what a prime number is, with examples.",
    "Describe how to make a cup of tea.",
    "What are the benefits of regular exercise?",
    "Tell me a fun fact about octopuses.",
    "How do vaccines train the immune system?",
)

Completion = tuple[list[int], list[float]]  # greedy token ids, logprob of each chosen token


@dataclass(frozen=True)
class RunResult:
    """One kv_cache_dtype's completions and the capacity its cache got."""

    kv_cache_dtype: str
    model_dtype: str
    completions: list[Completion]
    bytes_per_token: int
    num_tokens: int
    max_concurrency: float
    seconds: float


@dataclass(frozen=True)
class Agreement:
    """How one run's greedy completions compare with the reference (auto) run."""

    prefix_share: float
    overall_share: float
    identical_outputs: int
    num_outputs: int
    min_prefix: int
    logprob_mad: float
    logprob_max_diff: float


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest shared prefix of two token lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def compare(reference: list[Completion], other: list[Completion]) -> Agreement:
    """Agreement of `other` with `reference`, prompt by prompt (see the module docstring)."""
    prefix_total = same_total = ref_total = long_total = identical = 0
    diffs: list[float] = []
    prefixes: list[int] = []
    for (ref_ids, ref_lps), (ids, lps) in zip(reference, other, strict=True):
        prefix = common_prefix(ref_ids, ids)
        prefixes.append(prefix)
        prefix_total += prefix
        ref_total += len(ref_ids)
        same_total += sum(x == y for x, y in zip(ref_ids, ids, strict=False))
        long_total += max(len(ref_ids), len(ids))
        identical += ref_ids == ids
        diffs.extend(abs(x - y) for x, y in zip(ref_lps[:prefix], lps[:prefix], strict=True))
    return Agreement(prefix_total / max(ref_total, 1), same_total / max(long_total, 1),
                     identical, len(reference), min(prefixes, default=0),
                     sum(diffs) / max(len(diffs), 1), max(diffs, default=0.0))


def run_greedy(kv_cache_dtype: str, model_dtype: str, num_threads: int, max_tokens: int,
               prompts: Sequence[str] = PROMPTS) -> RunResult:
    """Greedy completions of every chat prompt with the embedded model and this cache dtype."""
    start = time.perf_counter()
    llm = LLM(kv_cache_dtype=kv_cache_dtype, dtype=model_dtype, num_threads=num_threads,
              kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    completions: list[Completion] = []
    for out in outs:
        choice = out.outputs[0]
        entries = choice.logprobs or []
        completions.append((list(choice.token_ids),
                            [e[t].logprob for t, e in zip(choice.token_ids, entries, strict=True)]))
    plan = llm.engine.kv_cache_plan
    return RunResult(kv_cache_dtype, model_dtype, completions, plan.bytes_per_token, plan.num_tokens,
                     plan.max_concurrency(MAX_MODEL_LEN), time.perf_counter() - start)


def render(results: list[RunResult]) -> str:
    """The markdown table: one row per run, agreement measured against the first (auto)."""
    reference = results[0]
    lines = [
        f"| kv_cache_dtype | model dtype | KV bytes/token | KV tokens in {KV_CACHE_MEMORY_BYTES // 2**20} MiB | "
        f"max concurrency @ {MAX_MODEL_LEN} | prefix agreement | overall agreement | "
        "identical outputs | shortest prefix | logprob MAD | logprob max diff | run s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        a = compare(reference.completions, result.completions)
        lines.append(
            f"| {result.kv_cache_dtype} | {result.model_dtype} | {result.bytes_per_token:,} | {result.num_tokens:,} | "
            f"{result.max_concurrency:.2f}x | {a.prefix_share:.1%} | {a.overall_share:.1%} | "
            f"{a.identical_outputs}/{a.num_outputs} | {a.min_prefix} | {a.logprob_mad:.4f} | "
            f"{a.logprob_max_diff:.4f} | {result.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every entry of RUNS and prints the comparison table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = [run_greedy(kv_dtype, model_dtype, ns.num_threads, ns.max_tokens)
               for kv_dtype, model_dtype in RUNS]
    print(f"{len(PROMPTS)} chat prompts x {ns.max_tokens} greedy tokens, SmolLM2-135M-Instruct, "
          "k_scale = v_scale = 1.0, agreement against the first row\n")
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
