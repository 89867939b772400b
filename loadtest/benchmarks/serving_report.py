"""The serving benchmark's report: the results table, kvserve / transformers ratios, the
target verdicts, the compute ceiling, warnings and notes on the peer."""

from __future__ import annotations

from typing import Any

from loadtest.benchmarks.common import format_table, ratio
from loadtest.benchmarks.machine import QUIET_CORES

THROUGHPUT_TARGET = 10.0  # kvserve output tok/s over transformers serve's, per level
PEER_NAME = "transformers"
GGUF_NAME = "kvserve-gguf"  # kvserve on the GGUF file the HF export was made from
ISSUE12_LEVEL = "c=64"  # issue 12: 64 streams on the embedded GGUF, >= 10x transformers serve

PEER_NOTES = [
    f"{GGUF_NAME} is kvserve serving the GGUF file the HF export was dequantized from, with "
    "its defaults for a GGUF (the Q4_1 blocks stay int4 in memory; activations in the dtype "
    "`--dtype auto` picks, bfloat16 on a CPU with AVX512-BF16 or AMX); transformers cannot serve a GGUF file without dequantizing it "
    "to float32 on load, which is what the export is",
    "kvserve runs with its defaults (prefix caching on, as in vLLM: the chat template's "
    "shared system prompt is reused; max-num-batched-tokens 8192 for this 8k-context "
    "model, so a burst of 64 prompts is prefilled in one step)",
    "`transformers serve` rejects fields outside its schema with HTTP 422 (so no vLLM-style "
    "`ignore_eos`); EOS is switched off there through its per-request `generation_config` "
    "JSON (`eos_token_id: -1`), kvserve gets `ignore_eos: true`",
    "it accepts `stream_options` but ignores it (logs a warning): usage always arrives on "
    "the last content chunk (with finish_reason), and the stream ends without `data: [DONE]`",
    "it also ignores (with a warning) `n`, `logprobs`, `top_logprobs`, `presence_penalty`, "
    "`response_format`, `tool_choice`, `user`; `seed` reseeds the whole process; with "
    "continuous batching only max_tokens and EOS are per request: the sampling settings of "
    "the first request are used for all",
    "on both servers a token that decodes to no text (a special token once EOS is ignored, "
    "part of a character) sends no content chunk, so a request can have fewer ITL gaps than "
    "tokens; output tokens always come from the servers' usage counts",
]


def level_rows(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    """One table row per (server, load level)."""
    rows: list[tuple[Any, ...]] = []
    for server in report["servers"]:
        if not server["levels"]:
            rows.append((server["name"], "-", "FAILED", None, None, None, None, None, None,
                         None, None))
        for lv in server["levels"]:
            rows.append((server["name"], lv["level"],
                         f"{lv['ok']}/{lv['failed']}" + (f" (+{lv['not_started']} not run)"
                                                         if lv["not_started"] else ""),
                         lv["output_tok_s"], lv["ttft_p50_ms"], lv["ttft_p99_ms"],
                         lv["itl_p50_ms"], lv["itl_p99_ms"], lv["e2e_p50_ms"],
                         lv["server_cores"], lv["other_cores"]))
    return rows


def results_table(report: dict[str, Any]) -> str:
    """The main table."""
    return format_table(("server", "load", "ok/failed", "output tok/s", "TTFT p50 (ms)",
                         "TTFT p99 (ms)", "ITL p50 (ms)", "ITL p99 (ms)", "E2E p50 (ms)",
                         "server CPU (cores)", "others' CPU (cores)"), level_rows(report))


def _levels(report: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    for server in report["servers"]:
        if server["name"] == name:
            return {lv["level"]: lv for lv in server["levels"]}
    return {}


def verdicts(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per kvserve server and load level measured on the peer too: the ratios and whether
    kvserve meets the target (>= 10x output tok/s, lower p99 TTFT, lower p99 ITL)."""
    peer = _levels(report, PEER_NAME)
    out = []
    for server in ("kvserve", GGUF_NAME):
        kv = _levels(report, server)
        for c in [level for level in kv if level in peer]:
            a, b = kv[c], peer[c]
            tps = ratio(a["output_tok_s"], b["output_tok_s"])
            ttft = ratio(a["ttft_p99_ms"], b["ttft_p99_ms"])
            itl = ratio(a["itl_p99_ms"], b["itl_p99_ms"])
            met = (tps is not None and tps >= THROUGHPUT_TARGET and ttft is not None
                   and ttft < 1 and itl is not None and itl < 1 and a["failed"] == 0)
            out.append({"server": server, "level": c, "tok_s_ratio": tps,
                        "ttft_p99_ratio": ttft, "itl_p99_ratio": itl,
                        "kvserve_failed": a["failed"], "met": met})
    return out


def verdict_table(report: dict[str, Any]) -> str:
    """kvserve / transformers ratios per server and level."""
    rows = [(v.get("server", "kvserve"), v["level"], _x(v["tok_s_ratio"]),
             _x(v["ttft_p99_ratio"]), _x(v["itl_p99_ratio"]), "met" if v["met"] else "MISSED")
            for v in report["verdicts"]]
    return format_table(("kvserve", "load", "output tok/s (kvserve / transformers)",
                         "TTFT p99 (kvserve / transformers)",
                         "ITL p99 (kvserve / transformers)", "target"), rows)


def _x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def warnings(report: dict[str, Any]) -> list[str]:
    """Server failures and CPU contention that make numbers suspect."""
    lines = []
    for server in report["servers"]:
        if server.get("error"):
            lines.append(f"WARNING: {server['name']} failed: {server['error'].splitlines()[0]}")
        for lv in server["levels"]:
            if lv["failed"]:
                lines.append(f"WARNING: {server['name']} {lv['level']}: {lv['failed']} "
                             f"failed requests, e.g. {lv['errors'][:2]}")
            if (lv["other_cores"] or 0.0) > QUIET_CORES:
                lines.append(f"WARNING: {server['name']} {lv['level']}: other processes "
                             f"kept {lv['other_cores']:.2f} cores busy; its timings understate it")
    return lines


def ceiling_tok_s(peak_gflops: float, params: int, lm_head_params: int, prompt_tokens: float,
                  output_tokens: int) -> float:
    """Output tokens/s if every linear layer ran at the matmul peak and nothing else cost
    time: each prompt and output token goes through the body once, and only output tokens
    (the last prompt position, at most) through the LM head."""
    body = params - lm_head_params
    flops = 2 * (body * (prompt_tokens + output_tokens) + lm_head_params * output_tokens)
    return peak_gflops * 1e9 * output_tokens / flops


def ceiling_lines(report: dict[str, Any]) -> list[str]:
    """The compute ceiling of the workload, next to what 10x the peer would need."""
    ceiling = report.get("ceiling")
    if not ceiling:
        return []
    peer = _levels(report, PEER_NAME)
    need = ", ".join(f"{level}: {THROUGHPUT_TARGET * lv['output_tok_s']:.0f}"
                     for level, lv in sorted(peer.items()))
    return [f"Compute ceiling of this workload: {ceiling['tok_s']:.0f} output tok/s (linear "
            f"layers only at the measured float32 matmul peak of {ceiling['peak_gflops']:.0f} "
            f"GFLOP/s, {ceiling['prompt_tokens']:.0f} prompt + {ceiling['output_tokens']} "
            f"output tokens a request, attention not counted)"
            + (f"; 10x transformers would need {need}" if need else "")]
