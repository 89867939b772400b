"""Benchmarks 1 and 2 of the suite, from one run of `loadtest.bench_offline`:
offline throughput (with the 64-sequence roofline) and batch-1 decode against the
memory-bandwidth floor. Both engines load the embedded SmolLM2 GGUF, dequantized to float32.
"""

from __future__ import annotations

from typing import Any

from loadtest.bench_config import (
    BATCH1_TARGET,
    QUIET_CORES,
    ROOFLINE_TARGET,
    THROUGHPUT_TARGET,
    BenchConfig,
)
from loadtest.bench_report import (
    batch1_table,
    machine_table,
    other_cpu_values,
    roofline_table,
    throughput_table,
)
from loadtest.benchmarks.common import SuiteContext, target_line

_CACHE_KEY = "bench_offline_report"


def measure(ctx: SuiteContext) -> dict[str, Any]:
    """Runs bench_offline once per suite (bfloat16 skipped: it is the dtype study of the
    offline page, not a target here) and keeps the report for both benchmarks."""
    if _CACHE_KEY not in ctx.extra:
        from loadtest.bench_offline import run

        cfg = BenchConfig(threads=ctx.threads, skip_bf16=True)
        ctx.extra[_CACHE_KEY] = run(cfg.quick() if ctx.quick else cfg)
    report: dict[str, Any] = ctx.extra[_CACHE_KEY]
    return report


def contention_note(report: dict[str, Any]) -> list[str]:
    busiest = max(other_cpu_values(report), default=0.0)
    if busiest > QUIET_CORES:
        return [f"Other processes kept up to {busiest:.2f} cores busy during a measurement."]
    return []


class Throughput:
    NAME = "Offline throughput"
    COMMAND = "python -m loadtest.bench_offline --skip-bf16"

    @staticmethod
    def run(ctx: SuiteContext) -> dict[str, Any]:
        r = measure(ctx)
        speedup, roof = r["ratios"]["vs_generate_batch"], r["roofline"]["fraction"]
        met = speedup >= THROUGHPUT_TARGET and roof >= ROOFLINE_TARGET
        return {"target": f">= {THROUGHPUT_TARGET:g}x transformers generate_batch output tok/s "
                          f"and >= {ROOFLINE_TARGET:.0%} of the roofline at "
                          f"{r['kvserve']['decode']['num_seqs']} sequences",
                "met": met, "summary": f"{speedup:.2f}x generate_batch, {roof:.0%} of roofline",
                "report": r}

    @staticmethod
    def render(result: dict[str, Any]) -> str:
        r, c = result["report"], result["report"]["config"]
        return "\n\n".join([
            f"{c['num_prompts']} prompts of random token ids, {c['min_input']}..{c['max_input']} "
            f"tokens in (evenly spread), {c['output_len']} out, greedy, EOS ignored.",
            "Machine rates, measured in the same run:", machine_table(r),
            throughput_table(r),
            f"generate_batch settings: {r['hf']['generate_batch']['settings']}",
            f"Decode step at {r['kvserve']['decode']['num_seqs']} sequences against its "
            "roofline (max of compute at the matmul peak and weight reads at read bandwidth):",
            roofline_table(r),
            target_line(result["target"], result["met"], result["summary"]),
            *contention_note(r)])


class Batch1:
    NAME = "Batch-1 decode vs the memory-bandwidth floor"
    COMMAND = "python -m loadtest.bench_offline --skip-bf16"

    @staticmethod
    def run(ctx: SuiteContext) -> dict[str, Any]:
        r = measure(ctx)
        frac = r["kvserve"]["batch1"]["tokens_per_s"] / r["batch1_floor_tokens_per_s"]
        return {"target": f">= {BATCH1_TARGET:.0%} of the floor (weight bytes / read "
                          "bandwidth, measured in the same run)",
                "met": frac >= BATCH1_TARGET, "summary": f"{frac:.0%} of the floor",
                "report": r}

    @staticmethod
    def render(result: dict[str, Any]) -> str:
        r = result["report"]
        return "\n\n".join([
            "One prompt of 16 tokens, 256 tokens generated greedily; the floor is the time "
            "to read every weight once per token at the measured read bandwidth.",
            batch1_table(r),
            target_line(result["target"], result["met"], result["summary"]),
            *contention_note(r)])
