"""The GPU check's plumbing on CPU (`--smoke`): every section runs, the summary and the JSON are
written, and the parity rule accepts only top-5 divergences; in the suite it is skipped without
CUDA. On a GPU the same code runs with full shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.benchmarks import gpu_check
from loadtest.benchmarks.common import SuiteContext
from loadtest.benchmarks.gpu_check import main
from loadtest.benchmarks.gpu_check_parity import divergence_ok


@pytest.mark.slow
def test_smoke_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["copy_gbs"] > 0
    kinds = {(row["kind"], row["first"], row["ctx"]) for row in data["attention"]}
    assert ("decode", 4, 256) in kinds and any(k[0] == "prefill" for k in kinds)
    assert all(row["ms"] > 0 and row["kv_gbs"] > 0 for row in data["attention"])
    variants = {row["variant"]: row for row in data["parity"]}
    assert set(variants) == {"eager", "fp8_e4m3 KV", "fp8_e5m2 KV", "int8 weights",
                             "int4 weights"}  # CUDA graphs need a GPU
    assert all(row["disallowed_divergences"] == 0 for row in variants.values())
    assert variants["int4 weights"]["reference"] == "kvserve on CPU, same method"
    assert data["offline"]["kvserve"]["tokens_per_s"] > 0
    assert data["offline"]["generate_batch"]["output_tokens"] == 8 * 8
    assert set(data["seconds"]) == {"bandwidth", "quant", "parity", "offline", "throughput"}
    # the quantized linears' torch paths (the Triton kernel needs a GPU or the interpreter)
    assert {(r["shape"], r["rows"]) for r in data["quant_linears"]["rows"]} == {("o", 1),
                                                                               ("o", 20)}
    assert all(r["bf16_ms"] > 0 and r["dequant_int4_ms"] > 0
               for r in data["quant_linears"]["rows"])
    assert [row["batch"] for row in data["llama8b_decode"]] == [1, 4]
    assert all(row["kvserve_eager"] > 0 and row["transformers"] > 0 and row["kvserve_int4"] > 0
               and row["kvserve_int8"] > 0 for row in data["llama8b_decode"])
    names = [row[0] for row in data["summary"]]
    assert any(name.startswith("parity tiny llama") for name in names)
    assert out.with_suffix(".md").read_text().startswith("Device: cpu (smoke)")


def test_divergence_rule() -> None:
    tops = [{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}]
    assert divergence_ok(([1, 6], tops), ([1, 6], tops))
    assert divergence_ok(([1, 6], tops), ([1, 7], tops))  # each in the other's top 5
    assert not divergence_ok(([1, 6], tops), ([1, 11], tops))  # theirs not in our top 5
    assert not divergence_ok(([1, 11], tops), ([1, 6], tops))  # ours not in their top 5


def test_a_failing_section_is_a_fail_row_and_the_rest_still_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from loadtest.benchmarks import gpu_check_kernels

    def broken(*args: object) -> float:
        raise RuntimeError("copy failed")
    monkeypatch.setattr(gpu_check_kernels, "copy_bandwidth", broken)
    out = tmp_path / "gpu_check.json"
    assert main(["--smoke", "--out", str(out), "--skip", "parity", "offline"]) == 1
    data = json.loads(out.read_text())
    assert ["section bandwidth", "RuntimeError: copy failed", "FAIL"] in data["summary"]
    assert [row["batch"] for row in data["llama8b_decode"]] == [1, 4]  # the next one ran


def test_suite_skips_it_without_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    result = gpu_check.run(SuiteContext(log_dir=tmp_path))
    assert result["skipped"] and result["met"] is None
    assert result["summary"] == "skipped: no CUDA GPU"
    text = gpu_check.render(result)
    assert "no CUDA GPU" in text and not list(tmp_path.iterdir())
    assert "Last run on a GPU (2026-11-30, one NVIDIA H200" in text  # docs/gpu_check.json
    assert "| decode attention, batch >= 64, 4k ctx | 98% of copy bandwidth" in text
    assert main(["--out", str(tmp_path / "x.json")]) == 2  # alone, without --smoke: refused


def test_suite_renders_a_gpu_result() -> None:
    result = {"target": gpu_check.TARGET, "met": True, "device": "NVIDIA H200",
              "summary": "kernel tests on cuda: PASS",
              "rows": [["kernel tests on cuda", "40 passed", "PASS"],
                       ["copy bandwidth", "3900 GB/s", ""]],
              "sections": {"llama8b_decode": [{"batch": 1, "kvserve_graphs": 150.0,
                                               "kvserve_eager": 60.0, "transformers": 40.0}]}}
    text = gpu_check.render(result)
    assert "| kernel tests on cuda | 40 passed | PASS    |" in text
    assert "| 1     | 60            | 150            | 40           |" in text
    assert "**Verdict: met.**" in text
