"""The benchmarks' verdicts and pages from known figures, no measuring: the serving ratios and
compute ceiling, the fp8 table and capacity verdict, the offline page from the stored run."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from loadtest.benchmarks import fp8_quality, offline, serving
from loadtest.benchmarks.common import DOCS
from loadtest.benchmarks.serving_report import (
    ceiling_lines,
    ceiling_tok_s,
    verdict_table,
    verdicts,
)


def level(name: str, tok_s: float, ttft99: float, itl99: float, failed: int = 0
          ) -> dict[str, Any]:
    """One measured level as the serving report stores it."""
    return {"level": name, "ok": 8, "failed": failed, "not_started": 0, "output_tok_s": tok_s,
            "ttft_p50_ms": ttft99 / 2, "ttft_p99_ms": ttft99, "itl_p50_ms": itl99 / 2,
            "itl_p99_ms": itl99, "e2e_p50_ms": 1.0, "server_cores": 1.0, "other_cores": 0.0,
            "errors": []}


def report(kv: list[dict[str, Any]], peer: list[dict[str, Any]],
           gguf: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A serving report with the servers' levels (kvserve on the GGUF when `gguf` is given)."""
    servers = [{"name": "kvserve", "levels": kv, "command": "kvserve serve"}]
    if gguf is not None:
        servers.append({"name": "kvserve-gguf", "levels": gguf, "command": "kvserve serve g"})
    return {"servers": [*servers, {"name": "transformers", "levels": peer,
                                   "command": "transformers"}]}


def test_serving_verdicts_need_every_ratio_and_no_failure() -> None:
    r = report([level("c=16", 200.0, 50.0, 5.0), level("c=64", 300.0, 90.0, 9.0, failed=1)],
               [level("c=16", 10.0, 100.0, 10.0), level("c=64", 20.0, 100.0, 10.0),
                level("rate=1/s", 5.0, 1.0, 1.0)])
    got = {v["level"]: v for v in verdicts(r)}
    assert set(got) == {"c=16", "c=64"}  # only levels both servers ran
    assert got["c=16"]["tok_s_ratio"] == pytest.approx(20.0) and got["c=16"]["met"]
    assert got["c=64"]["tok_s_ratio"] == pytest.approx(15.0) and not got["c=64"]["met"]
    r["verdicts"] = verdicts(r)
    judged = serving.judge(r, [])
    assert judged["met"] is False and judged["summary"].startswith("kvserve c=16: 20.00x tok/s")
    assert serving.judge(report([], []) | {"verdicts": []}, [])["met"] is None


def test_serving_judges_the_gguf_server_at_64_streams_only() -> None:
    """kvserve on the GGUF is held to issue 12's target at c=64; its other levels are shown
    but do not decide the verdict, and kvserve on the HF export is judged at every level."""
    peer = [level("c=16", 10.0, 100.0, 10.0), level("c=64", 20.0, 100.0, 10.0)]
    kv = [level("c=16", 200.0, 50.0, 5.0), level("c=64", 300.0, 90.0, 9.0)]
    r = report(kv, peer, gguf=[level("c=16", 50.0, 50.0, 5.0), level("c=64", 150.0, 90.0, 9.0)])
    r["verdicts"] = verdicts(r)
    got = {(v["server"], v["level"]): v for v in r["verdicts"]}
    assert set(got) == {(s, c) for s in ("kvserve", "kvserve-gguf") for c in ("c=16", "c=64")}
    assert not got[("kvserve-gguf", "c=16")]["met"]  # 5x: shown, not judged
    judged = serving.judge(r, [])
    assert judged["met"] is False  # the GGUF's 7.5x at c=64
    assert "kvserve-gguf c=64: 7.50x tok/s" in judged["summary"]
    assert "kvserve-gguf c=16" not in judged["summary"]
    r = report(kv, peer, gguf=[level("c=16", 50.0, 50.0, 5.0), level("c=64", 250.0, 90.0, 9.0)])
    r["verdicts"] = verdicts(r)
    assert serving.judge(r, [])["met"] is True
    assert "| kvserve-gguf | c=64 " in verdict_table(r)


def test_ceiling_counts_the_lm_head_for_output_tokens_only() -> None:
    # 100 GFLOP/s; 1e6 params of which 2e5 LM head; 100 prompt + 10 output tokens:
    # 2 * (8e5 * 110 + 2e5 * 10) = 1.8e8 FLOPs per request -> 10 tokens per 1.8 ms.
    assert ceiling_tok_s(100.0, 10**6, 2 * 10**5, 100.0, 10) == pytest.approx(5555.5, rel=1e-4)
    r = report([], [level("c=16", 40.0, 1.0, 1.0), level("rate=1/s", 30.0, 1.0, 1.0)])
    r["ceiling"] = {"tok_s": 224.0, "peak_gflops": 146.0, "prompt_tokens": 116.0,
                    "output_tokens": 64}
    line = ceiling_lines(r)[0]
    assert "224 output tok/s" in line and "would need c=16: 400, rate=1/s: 300" in line


def fp8_run(kv: str, model: str, tokens: int, ids: list[list[int]]) -> fp8_quality.RunResult:
    """A run whose completions have logprob -1 for every token."""
    per_token = 1000 * 2**20 // tokens
    return fp8_quality.RunResult(kv, model, [(c, [-1.0] * len(c)) for c in ids], per_token,
                                 tokens, tokens / 2048, 1.0)


def test_fp8_rows_compare_with_the_first_run_and_judge_capacity() -> None:
    ref = [[1, 2, 3, 4], [5, 6]]
    results = [fp8_run("auto", "float32", 1000, ref),
               fp8_run("fp8_e4m3", "float32", 4000, [[1, 2, 9, 9], [5, 6]]),
               fp8_run("fp8_e5m2", "float32", 4000, [[7], [5, 6]]),
               fp8_run("auto", "bfloat16", 2000, ref)]
    rows = fp8_quality.rows(results)
    assert rows[0]["prefix_share"] == 1.0 and rows[0]["identical_outputs"] == 2
    assert rows[1]["prefix_share"] == pytest.approx(4 / 6) and rows[1]["min_prefix"] == 2
    assert rows[2]["overall_share"] == pytest.approx(2 / 6)
    met, summary = fp8_quality.judge(rows)
    assert met is True and "4.00x the tokens of float32 auto, 2.00x of bfloat16" in summary
    assert fp8_quality.judge([rows[0]]) == (None, "a run is missing")
    result = {"target": fp8_quality.TARGET, "met": met, "summary": summary, "rows": rows,
              "num_prompts": 2, "max_tokens": 4, "kv_cache_memory_bytes": 2**28,
              "max_model_len": 2048}
    text = fp8_quality.render(result)
    assert "| fp8_e4m3       | float32     |" in text and "66.7%" in text
    assert "e4m3 keeps 66.7% of the tokens" in text


def test_offline_page_from_the_stored_run() -> None:
    saved = orjson.loads((DOCS / "benchmarks.json").read_bytes())
    stored = next(r for r in saved["results"] if r["key"] == "offline")
    judged = offline.Throughput.judge(stored["report"])
    assert {k: judged[k] for k in ("target", "met", "summary")} == \
        {k: stored[k] for k in ("target", "met", "summary")}
    page = offline.render_report(stored["report"])
    assert page.startswith("## Offline benchmark: SmolLM2-135M, 2 threads")
    assert offline.Throughput.render(judged) in page
    assert offline.Batch1.render(offline.Batch1.judge(stored["report"])) in page


def test_chunked_trace_summary_splits_the_window_and_compares_steps_to_both_paces() -> None:
    from loadtest.benchmarks.chunked_prefill_trace import summarize

    shallow = [{"seconds": 0.06, "predicted": 0.05, "decode_only": 0.03, "chunk": 16.0,
                "context": 100.0 * i} for i in range(10)]
    deep = [{"seconds": 0.09, "predicted": 0.09, "decode_only": 0.036, "chunk": 4.0,
             "context": 7000.0 + i} for i in range(10)]
    s = summarize(shallow + deep, base_s=0.03, parts=2)
    first, second = s["parts"]
    assert first["context"] == (0.0, 900.0) and second["context"] == (7000.0, 7009.0)
    assert (first["chunk"], second["chunk"]) == (16.0, 4.0)
    assert first["error_median"] == pytest.approx(1.2) and second["error_max"] == 1.0
    assert first["decode_only_ms"] == pytest.approx(30.0)
    # against the pace before the prompt the deep steps are 3x; against the decoders' own
    # (slower by then) decode-only step, 2.5x
    assert s["over_base"][1] == pytest.approx(3.0)
    assert s["over_decode_only"][1] == pytest.approx(2.5)
    assert s["steps"] == 20
