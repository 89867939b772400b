"""Issue 13's benchmarks: data parallelism, tensor parallelism and cache-aware routing on this
CPU, and the per-GPU KV arithmetic of a 70B-class model on 8x H200 from `kvserve plan`.

Five parts, each its own module, run one after the other (all ratios from one run):
  dp       `kvserve serve -dp 2` (1 thread per replica) vs one engine with 2 threads, same
           chat load: output tok/s and p99 TTFT              (distributed_serving.py)
  tp       decode step time with TP=1 and TP=2 at 1 and 64 sequences, and the share of a TP=2
           step rank 0 spends in its collectives             (distributed_tp.py)
  routing  our data-parallel routing and vllm-router's cache_aware policy vs round robin: hit
           rate and mean TTFT, 2 replicas, concurrency 1 and 16 (distributed_routing.py)
  plan     `kvserve plan` of Llama-3.1-70B's config on 8x H200, TP=8 and TP=4 x PP=2
           (distributed_plan.py)
  pp       PP=2 offline throughput with the batch queue vs one batch at a time, and one
           process with the same threads                     (distributed_pp.py)
A part that fails is reported with its error; the others still run. Alone:
`python -m loadtest.benchmarks.distributed [--quick] [--threads N] [--parts ...] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtest.benchmarks.common import SuiteContext

NAME = "Data and tensor parallelism, cache-aware routing"
COMMAND = "python -m loadtest.benchmarks.distributed"
TARGET = ("issue 13: ratios in one run (DP=2 vs one engine, TP=2 vs TP=1 with its "
          "communication share, routing vs round robin, 70B plan per GPU); held to: our "
          "cache-aware routing's prefix-cache hit rate above round robin's at every concurrency")
PARTS = ("dp", "tp", "routing", "plan", "pp")


def _part(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Runs one part; a crash becomes {"error": ...} so the other parts keep their figures."""
    print(f"-- distributed: {name}", flush=True)
    try:
        return fn()
    except Exception as exc:  # one broken part must not lose the others
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def run(ctx: SuiteContext) -> dict[str, Any]:
    """The selected parts (ctx.extra["distributed_parts"], default all), quick sizes with
    ctx.quick; ctx.extra["tp_model"] swaps the TP model (tests)."""
    from loadtest.benchmarks import (
        distributed_plan,
        distributed_pp,
        distributed_routing,
        distributed_serving,
        distributed_tp,
    )

    parts = list(ctx.extra.get("distributed_parts") or PARTS)
    ctx.log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"target": TARGET, "threads": ctx.threads, "quick": ctx.quick,
                              "parts": parts}
    if "dp" in parts:
        dp_cfg = distributed_serving.DPConfig.quick() if ctx.quick \
            else distributed_serving.DPConfig()
        result["dp"] = _part("dp", lambda: distributed_serving.run_dp(dp_cfg, ctx.threads,
                                                                      ctx.log_dir))
    if "tp" in parts:
        tp_cfg = distributed_tp.TPConfig.quick() if ctx.quick else distributed_tp.TPConfig()
        model = ctx.extra.get("tp_model")
        result["tp"] = _part("tp", lambda: distributed_tp.run_tp(
            ctx.log_dir, tp_cfg, Path(model) if model else None))
        if "rows" in result["tp"]:
            result["tp"]["speedups"] = {
                str(k): v for k, v in distributed_tp.tp_speedups(result["tp"]["rows"]).items()}
    if "routing" in parts:
        r_cfg = distributed_routing.RoutingConfig.quick() if ctx.quick \
            else distributed_routing.RoutingConfig()
        result["routing"] = _part("routing", lambda: distributed_routing.run_routing(
            r_cfg, ctx.threads, ctx.log_dir))
        if "setups" in result["routing"]:
            result["routing"]["compare"] = distributed_routing.compare(result["routing"])
    if "plan" in parts:
        result["plan"] = _part("plan", lambda: distributed_plan.run_plans(ctx.log_dir))
    if "pp" in parts:
        pp_cfg = distributed_pp.PPConfig.quick() if ctx.quick else distributed_pp.PPConfig()
        model = ctx.extra.get("tp_model")
        result["pp"] = _part("pp", lambda: distributed_pp.run_pp(
            ctx.log_dir, pp_cfg, Path(model) if model else None))
    result["met"], result["summary"] = verdict(result)
    return result


def verdict(result: dict[str, Any]) -> tuple[bool | None, str]:
    """Met when our routing's hit rate beats round robin's at every level; the summary gives
    the headline figure of every part that ran."""
    bits: list[str] = []
    met: bool | None = None
    for r in (result.get("dp") or {}).get("ratios", []):
        if r["tok_s_ratio"] is not None and r["ttft_p99_ratio"] is not None:
            bits.append(f"DP=2 c={r['concurrency']}: {r['tok_s_ratio']:.2f}x tok/s, "
                        f"{r['ttft_p99_ratio']:.2f}x p99 TTFT")
    for size, s in sorted((result.get("tp") or {}).get("speedups", {}).items(),
                          key=lambda kv: int(kv[0])):
        if s["comm_share"] is not None:
            gloo = s.get("gloo_comm_share")
            bits.append(f"TP=2 {size} seqs: comm {s['comm_share']:.0%} of the step"
                        + (f" (gloo: {gloo:.0%})" if gloo is not None else ""))
    compared = (result.get("routing") or {}).get("compare", [])
    checks = []
    for row in compared:
        ours, rr = row["ours"]["hit_rate"], row["round robin"]["hit_rate"]
        vr = row["vllm-router cache_aware"]["hit_rate"]
        bits.append(f"c={row['concurrency']} hit rate ours {_pct(ours)} / vllm-router "
                    f"{_pct(vr)} / round robin {_pct(rr)}")
        if ours is not None and rr is not None:
            checks.append(ours > rr)
    if checks:
        met = all(checks)
    layouts = (result.get("plan") or {}).get("layouts", [])
    if layouts:
        bits.append("70B on 8x H200: " + ", ".join(
            f"{lay['name']} {lay['kv_tokens'] / 1e6:.2f}M KV tokens" for lay in layouts))
    pp = result.get("pp") or {}
    if pp.get("batch_queue_gain"):
        bits.append(f"PP=2 batch queue {pp['batch_queue_gain']:.2f}x one batch at a time")
    errors = [p for p in PARTS if "error" in (result.get(p) or {})]
    if errors:
        bits.append(f"failed: {', '.join(errors)}")
    return met, "; ".join(bits) or "nothing measured"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def render(result: dict[str, Any]) -> str:
    """The page section (distributed_report.py)."""
    from loadtest.benchmarks.distributed_report import render_all

    return render_all(result)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: --quick, --threads, --parts, --json; prints the markdown section."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small workloads, a smoke run")
    p.add_argument("--threads", type=int, default=2, help="torch threads (split by DP and TP)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--json", dest="json_path", type=Path, default=None)
    ns = p.parse_args(argv)
    ctx = SuiteContext(threads=ns.threads, quick=ns.quick,
                       extra={"distributed_parts": ns.parts})
    ctx.apply_threads()
    result = run(ctx)
    print(render(result))
    if ns.json_path:
        ns.json_path.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
