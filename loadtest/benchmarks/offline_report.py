"""The offline benchmark's report: roofline arithmetic, the report dict and its tables."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig
from loadtest.benchmarks.common import format_table, ratio

if TYPE_CHECKING:
    from loadtest.benchmarks.offline_config import BenchConfig

Row = Sequence[Any]


# ---- pure helpers (unit-tested) -----------------------------------------------------------


def decode_step_flop_parts(num_params: int, num_layers: int, num_heads: int, head_dim: int,
                           mean_context: float, num_seqs: int) -> tuple[float, float]:
    """(linear layers: 2 x params per token, attention: QK^T and PV, 2 FLOPs each per
    head-dim element per cached position)."""
    linear = 2 * num_params * num_seqs
    attention = 2 * 2 * num_layers * num_heads * head_dim * mean_context * num_seqs
    return float(linear), float(attention)


def decode_step_flops(num_params: int, num_layers: int, num_heads: int, head_dim: int,
                      mean_context: float, num_seqs: int) -> float:
    """All of a decode step's FLOPs (see `decode_step_flop_parts`)."""
    return sum(decode_step_flop_parts(num_params, num_layers, num_heads, head_dim,
                                      mean_context, num_seqs))


def roofline_step_seconds(flops: float, weight_bytes: float, matmul_flops_per_s: float,
                          read_bytes_per_s: float) -> float:
    """The slower of compute time at the peak matmul rate and weight-read time."""
    return max(flops / matmul_flops_per_s, weight_bytes / read_bytes_per_s)


def bandwidth_floor_tokens_per_s(weight_bytes: float, read_bytes_per_s: float) -> float:
    """Batch-1 decode ceiling: each token reads every weight once."""
    return read_bytes_per_s / weight_bytes


# ---- report -------------------------------------------------------------------------------


def peak_rate(rates: dict[str, Any], arithmetic: str | None) -> float:
    """The machine's square-matmul rate (ops/s) for `arithmetic` (float32, bfloat16, int8),
    the float32 one where that was not measured."""
    measured = (rates.get("gemm_square_by_arithmetic") or {}).get(arithmetic or "")
    return float(measured or rates["gemm_square_gflops"]) * 1e9


def roofline_summary(mc: ModelConfig, rates: dict[str, Any], decode: dict[str, Any],
                     weight_bytes: int, arithmetic: dict[str, str] | None = None,
                     kv_element_bytes: int = 4) -> dict[str, Any]:
    """The decode-step roofline from the model shape, the machine rates and measured steps.

    `arithmetic` names what the engine multiplies in: {"linear": ..., "attention": ...}
    (float32, bfloat16 or int8: quantized weights on kvserve's tiled kernels multiply int8
    codes), each part timed at the machine's matmul peak for it; `kv_element_bytes` is the KV
    cache's element size (the attended KV bytes are reported beside the roofline)."""
    arithmetic = arithmetic or {}
    linear, attention = decode_step_flop_parts(
        mc.num_params(), mc.num_hidden_layers, mc.num_attention_heads, mc.head_dim,
        decode["mean_context"], decode["num_seqs"])
    compute_s = (linear / peak_rate(rates, arithmetic.get("linear"))
                 + attention / peak_rate(rates, arithmetic.get("attention")))
    read = rates["read_gbs"] * 1e9
    roof = roofline_step_seconds(linear + attention, weight_bytes,
                                 (linear + attention) / compute_s, read)
    kv_bytes = decode["num_seqs"] * decode["mean_context"] * mc.kv_bytes_per_token(
        kv_element_bytes)
    return {"flops": linear + attention, "weight_bytes": weight_bytes, "compute_s": compute_s,
            "memory_s": weight_bytes / read, "roofline_s": roof, "kv_bytes": kv_bytes,
            "achieved_s": decode["median_step_s"], "worker_s": decode["median_worker_s"],
            "fraction": roof / decode["median_step_s"], "arithmetic": arithmetic}


def build_report(cfg: BenchConfig, env: dict[str, Any], mc: ModelConfig, rates: dict[str, Any],
                 kv: dict[str, Any], bf16: dict[str, Any] | None, hf: dict[str, Any]
                 ) -> dict[str, Any]:
    """Everything the tables, JSON and markdown need, in one dict."""
    kv_tps = kv["throughput"]["tokens_per_s"]
    seq = hf.get("sequential")
    read = rates["read_gbs"] * 1e9
    return {
        "config": dataclasses.asdict(cfg), "env": env, "machine": rates,
        "kvserve": kv, "kvserve_bf16": bf16, "hf": hf,
        "ratios": {"vs_generate_batch": ratio(kv_tps, hf["generate_batch"]["tokens_per_s"]),
                   "vs_sequential": ratio(kv_tps, seq["tokens_per_s"] if seq else None)},
        "roofline": roofline_summary(mc, rates, kv["decode"], kv["weight_bytes"],
                                     kv.get("arithmetic"), kv.get("kv_element_bytes", 4)),
        "batch1_floor_tokens_per_s": bandwidth_floor_tokens_per_s(kv["weight_bytes"], read),
        "batch1_floor_float32_tokens_per_s": bandwidth_floor_tokens_per_s(
            mc.num_params() * 4, read),
    }


def throughput_table(r: dict[str, Any]) -> str:
    """Section 1: output tokens/s of the three ways to run the prompts."""
    runs = [("kvserve LLM.generate", r["kvserve"]["throughput"], 1.0),
            ("transformers generate_batch", r["hf"]["generate_batch"],
             r["ratios"]["vs_generate_batch"])]
    if r["hf"].get("sequential"):
        runs.append(("transformers generate, one at a time", r["hf"]["sequential"],
                     r["ratios"]["vs_sequential"]))
    rows = [(name, x["prompts"], x["output_tokens"], x["seconds"], x["tokens_per_s"], speedup,
             x["other_cpu_cores"]) for name, x, speedup in runs]
    return format_table(("engine", "prompts", "output tokens", "seconds", "output tok/s",
                         "kvserve speedup", "others' CPU (cores)"), rows)


def machine_table(r: dict[str, Any]) -> str:
    """The measured rates the roofline rests on."""
    m = r["machine"]
    return format_table(("measurement", "value", "method"), [
        ("matmul peak (GFLOP/s)", m["gemm_square_gflops"], m["gemm_square_shape"] + " float32"),
        *[(f"matmul peak, {kind} (G ops/s)", rate, m["gemm_square_shape"]
           + (" torch._int_mm, int32 sums" if kind == "int8" else f" {kind}"))
          for kind, rate in (m.get("gemm_square_by_arithmetic") or {}).items()
          if kind != "float32" and rate is not None],
        ("matmul decode-shaped (GFLOP/s)", m["gemm_decode_gflops"],
         m["gemm_decode_shape"] + " float32"),
        ("read bandwidth (GB/s)", m["read_gbs"], m["bandwidth_method"]),
        ("copy bandwidth (GB/s, read+write)", m["copy_gbs"], "copy_ of the same tensor"),
        ("others' CPU (cores)", m["other_cpu_cores"], "used by other processes meanwhile"),
    ])


def roofline_table(r: dict[str, Any]) -> str:
    """Section 2: the decode step at N sequences against its roofline."""
    rf, d = r["roofline"], r["kvserve"]["decode"]
    return format_table(("quantity", "value"), [
        ("sequences decoding", d["num_seqs"]), ("mean context (tokens)", d["mean_context"]),
        ("FLOPs per step (G)", rf["flops"] / 1e9),
        ("weight bytes per step (MB)", rf["weight_bytes"] / 1e6),
        ("KV bytes attended per step (MB, not in the roofline)", rf["kv_bytes"] / 1e6),
        ("multiplies in (linear / attention)", " / ".join(
            rf.get("arithmetic", {}).get(k, "float32") for k in ("linear", "attention"))),
        ("compute time at peak matmul rate (ms)", rf["compute_s"] * 1e3),
        ("weight-read time at read bandwidth (ms)", rf["memory_s"] * 1e3),
        ("roofline step (ms)", rf["roofline_s"] * 1e3),
        (f"kvserve step, median of {d['steps']} (ms)", rf["achieved_s"] * 1e3),
        ("  of which worker execute (ms)", rf["worker_s"] * 1e3),
        ("  outside the worker (ms)", (rf["achieved_s"] - rf["worker_s"]) * 1e3),
        ("decode tok/s", d["tokens_per_s"]), ("achieved / roofline", f"{rf['fraction']:.0%}"),
        ("others' CPU (cores)", d["other_cpu_cores"]),
    ])


def runs_text(r: dict[str, Any]) -> str:
    """How many batch-1 runs each engine made and their tokens/s (the tables give the
    median's)."""
    runs = [(name, r[key]["batch1"].get("runs_tokens_per_s") or [r[key]["batch1"]["tokens_per_s"]])
            for name, key in (("kvserve", "kvserve"), ("transformers", "hf"))]
    listed = "; ".join(f"{name} {', '.join(f'{v:.1f}' for v in tps)}" for name, tps in runs)
    return f"the median of {len(runs[0][1])} runs per engine (tok/s, lowest first: {listed})"


def batch1_table(r: dict[str, Any]) -> str:
    """Section 3: batch-1 decode against the bandwidth floor."""
    floor, floor_f32 = r["batch1_floor_tokens_per_s"], r["batch1_floor_float32_tokens_per_s"]
    kv, hf = r["kvserve"]["batch1"], r["hf"]["batch1"]
    return format_table(("engine", "tokens", "tok/s", "floor tok/s", "% of floor",
                         "others' CPU (cores)"), [
        (f"kvserve ({r['kvserve']['dtype']})", kv["tokens"], kv["tokens_per_s"], floor,
         f"{kv['tokens_per_s'] / floor:.0%}", kv["other_cpu_cores"]),
        ("transformers generate (float32)", hf["tokens"], hf["tokens_per_s"], floor_f32,
         f"{hf['tokens_per_s'] / floor_f32:.0%}", hf["other_cpu_cores"]),
    ])


def dtype_table(r: dict[str, Any]) -> str:
    """Section 4: float32 vs bfloat16 kvserve, each against its own bandwidth floor; the
    N-sequence column is the decode-step rate of section 2 (short context)."""
    rows: list[Row] = []
    for res in (r["kvserve"], r["kvserve_bf16"]):
        if res is None:
            continue
        floor = bandwidth_floor_tokens_per_s(res["weight_bytes"], r["machine"]["read_gbs"] * 1e9)
        b1, dec = res["batch1"], res["decode"]
        rows.append((res["dtype"], res["weight_bytes"] / 1e6, b1["tokens_per_s"],
                     f"{b1['tokens_per_s'] / floor:.0%}", dec["tokens_per_s"],
                     dec["median_step_s"] * 1e3,
                     max(b1["other_cpu_cores"] or 0.0, dec["other_cpu_cores"] or 0.0)))
    return format_table(("dtype", "weights (MB)", "batch-1 tok/s", "% of own floor",
                         f"{r['kvserve']['decode']['num_seqs']}-seq decode tok/s",
                         "step (ms)", "others' CPU (cores, max)"), rows)


def faster(a: tuple[str, float], b: tuple[str, float]) -> str:
    """'NAME (R.RRx)': which of two (name, tokens/s) pairs is faster, and by how much."""
    win, lose = (a, b) if a[1] >= b[1] else (b, a)
    return f"{win[0]} ({win[1] / lose[1]:.2f}x)"


def dtype_verdict(r: dict[str, Any]) -> list[str]:
    """One line saying which dtype wins where, for the README's `dtype=auto` choice."""
    f32, bf16 = r["kvserve"], r["kvserve_bf16"]
    if bf16 is None or f32["dtype"] != "float32":
        return []
    n = f32["decode"]["num_seqs"]
    pairs = [((d["dtype"], d["decode"]["tokens_per_s"]), (d["dtype"], d["batch1"]["tokens_per_s"]))
             for d in (f32, bf16)]
    return [f"faster at {n} sequences: {faster(pairs[0][0], pairs[1][0])}; faster at batch 1: "
            f"{faster(pairs[0][1], pairs[1][1])}; cpu: {r['env']['cpu']}"]
