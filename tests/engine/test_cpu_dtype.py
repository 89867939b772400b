"""`--dtype auto` on CPU: bfloat16 where oneDNN runs bf16 matmuls natively, float32 elsewhere.

The session fixture in tests/conftest.py shows every other test a CPU without native bf16; these
tests choose the flags themselves, so both choices are covered on any machine.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, cpu_features
from engine.config import EngineArgs
from engine.cpu_features import auto_cpu_dtype, native_bf16_flags, parse_cpu_flags

# The real reader, taken before the session fixture replaces the module's.
READ_CPU_FLAGS = cpu_features.read_cpu_flags
CPU = torch.device("cpu")

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu sse2
"""


def test_parse_cpu_flags_reads_the_first_processor() -> None:
    flags = parse_cpu_flags(CPUINFO)
    assert {"avx2", "avx512f", "avx512_bf16"} <= flags
    assert "sysret_ss_attrs" not in flags
    assert parse_cpu_flags("processor: 0\n") == frozenset()


def test_read_cpu_flags_from_a_file_and_without_one(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert "avx512_bf16" in READ_CPU_FLAGS.__wrapped__(path)
    assert READ_CPU_FLAGS.__wrapped__(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize("flags, native", [
    ({"avx2", "avx512f", "avx512_bf16"}, ["avx512_bf16"]),
    ({"avx2", "amx_tile", "amx_bf16"}, ["amx_bf16"]),
    ({"avx512_bf16", "amx_bf16"}, ["avx512_bf16", "amx_bf16"]),
])
def test_auto_is_bfloat16_with_native_bf16(flags: set[str], native: list[str]) -> None:
    dtype, why = auto_cpu_dtype(flags)
    assert dtype == torch.bfloat16
    assert native_bf16_flags(flags) == native
    assert ", ".join(native) in why and "natively" in why


@pytest.mark.parametrize("flags", [set(), {"avx2", "fma"}, {"avx512f", "avx512bw", "avx512_vnni"}])
def test_auto_is_float32_without_native_bf16(flags: set[str]) -> None:
    dtype, why = auto_cpu_dtype(flags)
    assert dtype == torch.float32
    assert "lacks avx512_bf16 and amx_bf16" in why


def test_auto_is_float32_without_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    dtype, why = auto_cpu_dtype({"avx512_bf16"})
    assert dtype == torch.float32 and "lacks oneDNN" in why


def test_resolved_dtype_follows_the_cpu_and_explicit_dtypes_win(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineArgs().resolved_dtype(CPU) == torch.float32  # the session's CPU
    monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert EngineArgs().resolved_dtype(CPU) == torch.bfloat16
    assert EngineArgs(dtype="float32").resolved_dtype(CPU) == torch.float32
    assert EngineArgs().resolved_dtype(torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda: frozenset({"avx2"}))
    assert EngineArgs().resolved_dtype(CPU) == torch.float32
    assert EngineArgs(dtype="bfloat16").resolved_dtype(CPU) == torch.bfloat16


@pytest.mark.parametrize("flags, expected", [({"avx512_bf16"}, torch.bfloat16),
                                             ({"avx2"}, torch.float32)])
def test_engine_loads_in_the_auto_dtype_and_says_why(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        flags: set[str], expected: torch.dtype) -> None:
    monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda: frozenset(flags))
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(tiny_llama_dir), num_threads=1, max_model_len=256)
    runner = llm.engine.runner
    assert runner.dtype == expected
    assert all(p.dtype == expected for p in runner.model.parameters())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--dtype auto")]
    name = str(expected).removeprefix("torch.")
    assert len(lines) == 1 and lines[0].startswith(f"--dtype auto: {name} on this CPU: ")
    out = llm.generate("the cat", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_an_explicit_dtype_logs_no_auto_line(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(tiny_llama_dir), dtype="float32", num_threads=1, max_model_len=256)
    assert llm.engine.runner.dtype == torch.float32
    assert not [r for r in caplog.records if r.getMessage().startswith("--dtype auto")]
