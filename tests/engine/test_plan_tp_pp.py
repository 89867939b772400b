"""`kvserve plan -tp T -pp N`: the planner's per-GPU arithmetic for tensor parallelism inside
pipeline stages (the engine itself still refuses the combination)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import main


def _plan(capsys: pytest.CaptureFixture[str], model: Path, *flags: str) -> str:
    assert main(["plan", str(model), "--memory", "1GiB", *flags]) == 0
    return capsys.readouterr().out


def test_plan_splits_each_stage_over_its_tensor_parallel_ranks(
        tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Tiny Llama (2 layers, 4 heads / 2 KV heads): -pp 2 holds 1 layer x 2 KV heads per
    GPU, -tp 2 -pp 2 1 layer x 1 KV head, on 4 GPUs."""
    pp = _plan(capsys, tiny_llama_dir, "-pp", "2")
    both = _plan(capsys, tiny_llama_dir, "-tp", "2", "-pp", "2")
    assert "bytes per token     128 B = 2 x 1 layers x 2 KV heads" in pp
    assert "bytes per token     64 B = 2 x 1 layers x 1 KV heads" in both
    assert "--tensor-parallel-size 2 within each stage (4 GPUs): each GPU holds 2 heads / " \
           "1 KV heads" in both
    assert "per GPU (tensor parallel size 2 x pipeline parallel size 2" in both
    assert "Memory per GPU" in both


def test_plan_still_checks_the_tensor_parallel_size_of_a_stage(
        tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tiny_llama_dir), "--memory", "1GiB", "-tp", "3", "-pp", "2"]) == 2
    assert "tensor_parallel_size 3 does not divide this model" in capsys.readouterr().err
