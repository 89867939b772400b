"""fp8 KV cache: capacity and quality, greedy agreement and logprob drift against
`--kv-cache-dtype auto` on the embedded SmolLM2-135M-Instruct.

`LLM()` serves the same chat prompts with kv_cache_dtype auto, fp8_e4m3 and fp8_e5m2 (per-layer
scales 1.0, vLLM's default) on a float32 model, then auto on a bfloat16 model: the yardstick, how
far a precision change every GPU deployment accepts already moves greedy output on this model.
The weights are the GGUF's dequantized (`quantization="none"`): kvserve's default for a GGUF
keeps its 4-bit blocks and quantizes activations to int8 inside each linear, which would fold
that rounding into every row and blur what the cache alone does.
Every run gets the same KV budget, so the capacity columns compare like for like.

Metrics, each against the first (auto, float32) run of the same prompt:
- prefix agreement: tokens before the first divergence / tokens auto generated. Greedy decoding
  is autoregressive, so after one flipped token the continuations differ for a benign reason;
  this is the strict number.
- overall agreement: positions holding the same token / the longer output's length.
- identical outputs: prompts whose whole completion equals auto's.
- logprob MAD: mean |logprob_fp8 - logprob_auto| of the chosen token over the common prefix
  (the same context, so the difference is the cache's rounding alone).
Alone: `python -m loadtest.benchmarks.fp8_quality [--quick] [--threads N] [--json PATH]`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loadtest.benchmarks.common import SuiteContext, format_table, run_alone, target_line

if TYPE_CHECKING:
    from engine import LLM

NAME = "fp8 KV cache: capacity and quality"
COMMAND = "python -m loadtest.benchmarks.fp8_quality"
TARGET = ("fp8_e4m3 holds 2x the KV tokens of a 16-bit cache in the same memory (4x a float32 "
          "one); greedy agreement with auto is reported, with no target")

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


def greedy_chat(llm: LLM, prompts: Sequence[str], max_tokens: int) -> list[Completion]:
    """Greedy chat completions with the chosen token's logprob at every position (the quantization
    benchmark's agreement runs use it too)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    result: list[Completion] = []
    for out in outs:
        choice = out.outputs[0]
        entries = choice.logprobs or []
        result.append((list(choice.token_ids),
                       [e[t].logprob for t, e in zip(choice.token_ids, entries, strict=True)]))
    return result


def run_greedy(kv_cache_dtype: str, model_dtype: str, num_threads: int, max_tokens: int,
               prompts: Sequence[str] = PROMPTS) -> RunResult:
    """Greedy completions of every chat prompt with the embedded model and this cache dtype."""
    from engine import LLM

    start = time.perf_counter()
    llm = LLM(kv_cache_dtype=kv_cache_dtype, dtype=model_dtype, num_threads=num_threads,
              kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES, max_model_len=MAX_MODEL_LEN,
              quantization="none")
    completions = greedy_chat(llm, prompts, max_tokens)
    plan = llm.engine.kv_cache_plan
    return RunResult(kv_cache_dtype, model_dtype, completions, plan.bytes_per_token, plan.num_tokens,
                     plan.max_concurrency(MAX_MODEL_LEN), time.perf_counter() - start)


# ---- suite interface ----------------------------------------------------------------------


def rows(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One JSON-able row per run: its capacity and its agreement with the first run."""
    reference = results[0].completions
    return [{"kv_cache_dtype": r.kv_cache_dtype, "model_dtype": r.model_dtype,
             "bytes_per_token": r.bytes_per_token, "num_tokens": r.num_tokens,
             "max_concurrency": r.max_concurrency, "seconds": r.seconds,
             **dataclasses.asdict(compare(reference, r.completions))} for r in results]


def judge(table: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """Met when fp8_e4m3 holds >= 2x the tokens of the 16-bit run and >= 4x the float32 one."""
    by_run = {(r["kv_cache_dtype"], r["model_dtype"]): r for r in table}
    e4m3, f32 = by_run.get(("fp8_e4m3", "float32")), by_run.get(("auto", "float32"))
    bf16 = by_run.get(("auto", "bfloat16"))
    if e4m3 is None or f32 is None or bf16 is None:
        return None, "a run is missing"
    vs_f32, vs_bf16 = e4m3["num_tokens"] / f32["num_tokens"], e4m3["num_tokens"] / bf16["num_tokens"]
    return vs_f32 >= 4 and vs_bf16 >= 2, (
        f"fp8_e4m3 holds {vs_f32:.2f}x the tokens of float32 auto, {vs_bf16:.2f}x of bfloat16 "
        f"auto; {e4m3['prefix_share']:.1%} prefix agreement, logprob MAD "
        f"{e4m3['logprob_mad']:.4f}")


def run(ctx: SuiteContext) -> dict[str, Any]:
    """Every entry of RUNS over the prompts (4 prompts x 8 tokens with --quick)."""
    logging.basicConfig(level=logging.WARNING)
    prompts = PROMPTS[:4] if ctx.quick else PROMPTS
    max_tokens = int(ctx.extra.get("max_tokens", 8 if ctx.quick else 64))
    results = [run_greedy(kv, model, ctx.threads, max_tokens, prompts) for kv, model in RUNS]
    table = rows(results)
    met, summary = judge(table)
    return {"target": TARGET, "met": met, "summary": summary, "threads": ctx.threads,
            "num_prompts": len(prompts), "max_tokens": max_tokens, "quick": ctx.quick,
            "kv_cache_memory_bytes": KV_CACHE_MEMORY_BYTES, "max_model_len": MAX_MODEL_LEN,
            "rows": table}


def _row(r: dict[str, Any]) -> list[Any]:
    """One table row, formatted as the page shows it."""
    return [r["kv_cache_dtype"], r["model_dtype"], f"{r['bytes_per_token']:,}",
            f"{r['num_tokens']:,}", f"{r['max_concurrency']:.2f}x", f"{r['prefix_share']:.1%}",
            f"{r['overall_share']:.1%}", f"{r['identical_outputs']}/{r['num_outputs']}",
            r["min_prefix"], f"{r['logprob_mad']:.4f}", f"{r['logprob_max_diff']:.4f}",
            f"{r['seconds']:.0f}"]


def _reading(table: list[dict[str, Any]]) -> list[str]:
    """What the table says, with its own figures."""
    e4m3, e5m2, bf16 = table[1], table[2], table[3]
    return [
        f"- **Capacity**: bytes per token fall by the model dtype's element size: "
        f"{table[0]['bytes_per_token'] / e4m3['bytes_per_token']:.0f}x against a float32 model "
        f"(the CPU default), {bf16['bytes_per_token'] / e4m3['bytes_per_token']:.0f}x against "
        f"bfloat16 (the GPU case): {bf16['num_tokens']:,} tokens / {bf16['max_concurrency']:.2f}x "
        f"concurrency with auto on a bfloat16 model, {e4m3['num_tokens']:,} / "
        f"{e4m3['max_concurrency']:.2f}x with fp8_e4m3, as `kvserve generate --dtype bfloat16 "
        "--kv-cache-memory-bytes 268435456 --max-model-len 2048` logs them at startup. For a "
        "GPU-sized budget, `kvserve plan --memory 24GiB --max-model-len 8192 --kv-cache-dtype "
        "fp8_e4m3` prints both dtypes' token counts side by side (the same 2x).",
        f"- **Quality**: greedy decoding amplifies near-ties: e4m3 keeps "
        f"{e4m3['prefix_share']:.1%} of the tokens before the first divergence (logprobs move "
        f"by {e4m3['logprob_mad']:.4f} nats on average), e5m2 {e5m2['prefix_share']:.1%} "
        f"({e5m2['logprob_mad']:.4f}). For scale, the whole model in bfloat16 keeps "
        f"{bf16['prefix_share']:.1%} and moves logprobs by {bf16['logprob_mad']:.4f} nats. "
        "e4m3 (3 mantissa bits) beats e5m2 (2 bits): use `fp8_e4m3` (or `fp8`) unless K/V "
        "values exceed 448 in magnitude.",
        "- **Scales** (measured once by hand, not by this benchmark): SmolLM2's K/V stay "
        "within |18| on the first prompts, so saturation never triggers at scale 1.0, and "
        "scales of 1/16 on every layer gave e4m3 47.5% prefix agreement and 0.046 logprob MAD, "
        "the same as 1.0 within the noise of which near-ties flip; calibration (vLLM's "
        "`--calculate-kv-scales`) was not added.",
        "- **Correctness**: tests/engine/test_fp8_kv.py checks that the fp8 engine reproduces, "
        "token for token, a float32 engine whose K/V are rounded through fp8 before caching, "
        "so the agreement above is the format's rounding, not an implementation error."]


def render(result: dict[str, Any]) -> str:
    """The workload, one row per run, the target line and how to read it."""
    table = result["rows"]
    headers = ["kv_cache_dtype", "model dtype", "KV bytes/token",
               f"KV tokens in {result['kv_cache_memory_bytes'] // 2**20} MiB",
               f"max concurrency @ {result['max_model_len']}", "prefix agreement",
               "overall agreement", "identical outputs", "shortest prefix", "logprob MAD",
               "logprob max diff", "run s"]
    return "\n\n".join([
        f"{result['num_prompts']} fixed chat prompts (SmolLM2-135M-Instruct with its chat "
        f"template), {result['max_tokens']} greedy tokens each, logprobs=1, the same KV budget "
        "and max_model_len for every run, k_scale = v_scale = 1.0. Every row is compared with "
        "the first (auto, float32 model: the CPU default); prefix agreement counts tokens "
        "before the first divergence, logprob MAD is over that common prefix (nats).",
        format_table(headers, [_row(r) for r in table]),
        target_line(result["target"], result["met"], result["summary"]),
        "\n".join(_reading(table)) if len(table) == len(RUNS) else ""])


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: --quick, --threads, --json; prints the rendered markdown."""
    run_alone(NAME, run, render, argv)


if __name__ == "__main__":
    main()
