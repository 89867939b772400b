"""Offline benchmarks: throughput (with the 64-sequence roofline) and batch-1 decode against the
memory-bandwidth floor, kvserve vs. transformers on SmolLM2-135M, from one measurement.

Both engines load the same embedded GGUF: transformers dequantizes it to float32; kvserve runs it
as `kvserve serve` does, `--dtype auto` in the suite (bfloat16 on CPUs with native bf16 matmuls,
else float32; the report names the dtype it resolved to) with the Q4 layers in place, and the
roofline is computed for that dtype and weight format. Alone: `python -m
loadtest.benchmarks.offline [--threads 2] [--dtype D] [--quick] [--skip-bf16] [--json PATH]
[--markdown PATH]` (kvserve in float32 unless --dtype says otherwise) prints both sections plus a
float32 vs. bfloat16 study for kvserve (the `dtype=auto` choice on CPU); nothing here asserts on
time.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.benchmarks.common import SuiteContext, target_line
from loadtest.benchmarks.machine import QUIET_CORES, other_cpu_values
from loadtest.benchmarks.offline_config import BenchConfig
from loadtest.benchmarks.offline_report import (
    batch1_table,
    dtype_table,
    dtype_verdict,
    machine_table,
    roofline_table,
    runs_text,
    throughput_table,
)
from loadtest.benchmarks.offline_run import run

THROUGHPUT_TARGET = 10.0  # kvserve / generate_batch
ROOFLINE_TARGET = 0.50  # achieved / roofline at 64 sequences
BATCH1_TARGET = 0.85  # achieved / bandwidth floor at batch 1
COMMAND = "python -m loadtest.benchmarks.offline --dtype auto --skip-bf16"
_CACHE_KEY = "offline_report"


def measure(ctx: SuiteContext) -> dict[str, Any]:
    """Runs the offline measurement once per suite, kvserve with `--dtype auto` as `kvserve
    serve` runs (the second, bfloat16 engine skipped: it is the dtype study of the standalone
    run, not a target here), and keeps the report for both benchmarks."""
    if _CACHE_KEY not in ctx.extra:
        cfg = BenchConfig(threads=ctx.threads, skip_bf16=True, dtype="auto")
        ctx.extra[_CACHE_KEY] = run(cfg.quick() if ctx.quick else cfg)
    report: dict[str, Any] = ctx.extra[_CACHE_KEY]
    return report


def contention_note(report: dict[str, Any]) -> list[str]:
    """A warning when other processes took CPU during a measurement."""
    busiest = max(other_cpu_values(report), default=0.0)
    if busiest > QUIET_CORES:
        return [f"Other processes kept up to {busiest:.2f} cores busy during a measurement."]
    return []


class Throughput:
    """Offline throughput against transformers' generate_batch and the decode roofline."""

    NAME = "Offline throughput"
    COMMAND = COMMAND

    @staticmethod
    def run(ctx: SuiteContext) -> dict[str, Any]:
        """Measures (shared with Batch1) and judges."""
        return Throughput.judge(measure(ctx))

    @staticmethod
    def judge(r: dict[str, Any]) -> dict[str, Any]:
        """The suite result of an offline report."""
        speedup, roof = r["ratios"]["vs_generate_batch"], r["roofline"]["fraction"]
        met = speedup >= THROUGHPUT_TARGET and roof >= ROOFLINE_TARGET
        return {"target": f">= {THROUGHPUT_TARGET:g}x transformers generate_batch output tok/s "
                          f"and >= {ROOFLINE_TARGET:.0%} of the roofline at "
                          f"{r['kvserve']['decode']['num_seqs']} sequences",
                "met": met, "summary": f"{speedup:.2f}x generate_batch, {roof:.0%} of roofline",
                "report": r}

    @staticmethod
    def render(result: dict[str, Any]) -> str:
        """Workload, machine rates, throughput and roofline tables, target line."""
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
    """Batch-1 decode against the memory-bandwidth floor."""

    NAME = "Batch-1 decode vs the memory-bandwidth floor"
    COMMAND = COMMAND

    @staticmethod
    def run(ctx: SuiteContext) -> dict[str, Any]:
        """Measures (shared with Throughput) and judges."""
        return Batch1.judge(measure(ctx))

    @staticmethod
    def judge(r: dict[str, Any]) -> dict[str, Any]:
        """The suite result of an offline report."""
        frac = r["kvserve"]["batch1"]["tokens_per_s"] / r["batch1_floor_tokens_per_s"]
        return {"target": f">= {BATCH1_TARGET:.0%} of the floor (weight bytes / read "
                          "bandwidth, measured in the same run)",
                "met": frac >= BATCH1_TARGET, "summary": f"{frac:.0%} of the floor",
                "report": r}

    @staticmethod
    def render(result: dict[str, Any]) -> str:
        """The batch-1 table and the target line."""
        r = result["report"]
        return "\n\n".join([
            "One prompt of 16 tokens, 256 tokens generated greedily, "
            f"{runs_text(r)}; the floor is the time to read every weight once per token at "
            "the measured read bandwidth.",
            batch1_table(r),
            target_line(result["target"], result["met"], result["summary"]),
            *contention_note(r)])


def render_report(r: dict[str, Any]) -> str:
    """The standalone page: both suite sections, the dtype study and the decode profile."""
    env = r["env"]
    parts = [f"## Offline benchmark: SmolLM2-135M, {r['config']['threads']} threads",
             f"threads={r['config']['threads']} torch={env['torch']} "
             f"transformers={env['transformers']} cpu={env['cpu']}"]
    for bench in (Throughput, Batch1):
        parts += [f"### {bench.NAME}", bench.render(bench.judge(r))]
    if r["kvserve_bf16"] is not None:
        parts += ["### float32 vs. bfloat16 (kvserve)", dtype_table(r), *dtype_verdict(r)]
    profile = r["kvserve"]["decode"].get("profile")
    if profile:
        parts += ["### Decode-step profile (kvserve, torch.profiler)", f"```\n{profile}\n```"]
    return "\n\n".join(parts) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    """Reads the command line into a BenchConfig."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads for every engine")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-input", type=int, default=32)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="kvserve dtype of the main runs")
    p.add_argument("--skip-hf-sequential", action="store_true")
    p.add_argument("--hf-sequential-prompts", type=int, default=8,
                   help="prompts for transformers' one-at-a-time generate (64 take ~7 min)")
    p.add_argument("--hf-page-size", type=int, default=256, help="generate_batch page_size")
    p.add_argument("--hf-max-batch-tokens", type=int, default=512,
                   help="generate_batch max_batch_tokens")
    p.add_argument("--skip-bf16", action="store_true", help="skip the bfloat16 engine")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each timing, wait up to this long for other processes to idle")
    p.add_argument("--profile-decode", action="store_true",
                   help="print torch.profiler's top ops over a few decode steps")
    p.add_argument("--quick", action="store_true", help="small everything, for a smoke run")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--markdown", dest="markdown_path")
    ns = vars(p.parse_args(argv))
    quick = ns.pop("quick")
    cfg = BenchConfig(**ns)
    return cfg.quick() if quick else cfg


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: run, print, and write JSON / markdown when asked."""
    cfg = parse_args(argv)
    report = run(cfg)
    text = render_report(report)
    print(text)
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(report, indent=2, default=str))
    if cfg.markdown_path:
        Path(cfg.markdown_path).write_text(text)


if __name__ == "__main__":
    main()
