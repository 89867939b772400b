"""`--cpu-offload-gb`: on CPU the offloaded weights live in a separate host copy and a fresh
working copy is made per layer call (engine/worker/offload.py), so the mechanism runs here as
on CUDA: outputs equal, the budget respected per tensor, nothing offloaded left resident
between steps, the capacity lines and the plan counting it, and bad values refused."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine import LLM, ModelConfig, SamplingParams
from engine.capacity import capacity_log_lines, make_kv_cache_plan
from engine.config import EngineArgs, engine_args_from_flags
from engine.models.cpu_layer import FusedLayer
from engine.models.llama import DecoderLayer
from engine.planner import build_plan, format_plan
from engine.quantization import quantized_weight_bytes
from engine.worker.model_runner import ModelRunner
from engine.worker.offload import (
    GiB,
    budget_bytes,
    count_within_budget,
    layer_weight_tensors,
    planned_layer_tensor_bytes,
    tensor_bytes,
)
from server.cli import build_parser, main
from tests.support.tiny_models import random_prompts

KWARGS: dict[str, Any] = {"max_model_len": 256, "num_threads": 1,
                          "kv_cache_memory_bytes": 4 * 2**20}
# The tiny float32 models' layers take ~145 KiB each: this covers layer 0 and part of layer 1.
PART_GB = 0.00015
ALL_GB = 1.0


def outputs(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy token ids and top-3 logprobs of a fixed mix of short and longer prompts."""
    prompts = random_prompts(512, 6, 3, 60, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs or []])
            for o in outs]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(f"tiny_{request.param}_dir"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[Any]:
    return outputs(LLM(str(model_dir), dtype="float32", **KWARGS))


@pytest.mark.parametrize("cpu_offload_gb", [PART_GB, ALL_GB])
def test_outputs_and_logprobs_equal_without_offload(model_dir: Path, reference: list[Any],
                                                    cpu_offload_gb: float) -> None:
    llm = LLM(str(model_dir), dtype="float32", cpu_offload_gb=cpu_offload_gb, **KWARGS)
    offload = llm.engine.runner.offload
    assert offload is not None and offload.tensors
    partial = len(offload.tensors) < offload.num_layer_tensors
    assert partial == (cpu_offload_gb == PART_GB)
    assert outputs(llm) == reference
    assert offload.num_copies > 0  # the weights really came through working copies
    layer = llm.engine.runner.model.layers[0]
    if layer.ops is not None:  # the C++ decode layer served the offloaded layer's decodes
        assert isinstance(layer._fused, FusedLayer)


def test_python_layer_path_with_offload(tiny_llama_dir: Path) -> None:
    # the torch backend: no C++ decoder layer, every module reads its tensors itself
    kwargs = {**KWARGS, "dtype": "float32", "attention_backend": "torch"}
    expected = outputs(LLM(str(tiny_llama_dir), **kwargs))
    llm = LLM(str(tiny_llama_dir), cpu_offload_gb=PART_GB, **kwargs)
    assert llm.engine.runner.model.layers[0].ops is None
    assert outputs(llm) == expected


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_codes_offload_with_equal_outputs(tiny_llama_dir: Path, method: str) -> None:
    # bfloat16: the fused kernels' packed layouts (tiles, or torch's int4 pack) are offloaded
    kwargs = {**KWARGS, "dtype": "bfloat16", "quantization": method}
    expected = outputs(LLM(str(tiny_llama_dir), **kwargs))
    llm = LLM(str(tiny_llama_dir), cpu_offload_gb=ALL_GB, **kwargs)
    offload = llm.engine.runner.offload
    assert offload is not None
    names = [t.name for t in offload.tensors]
    assert "layers.0.self_attn.qkv_proj.qweight" in names
    assert len(names) == offload.num_layer_tensors
    assert outputs(llm) == expected


def test_count_within_budget_stops_at_the_first_that_does_not_fit() -> None:
    assert count_within_budget([3, 3, 3], 7) == 2
    assert count_within_budget([5, 10, 1], 8) == 1  # never skips ahead to a smaller one
    assert count_within_budget([4, 4], 8) == 2  # exactly the budget is within it
    assert count_within_budget([9], 8) == 0
    assert count_within_budget([], 8) == 0
    assert budget_bytes(0.5) == GiB // 2


@pytest.mark.parametrize("cpu_offload_gb", [0.00005, PART_GB])
def test_budget_is_respected_per_tensor(tiny_llama_dir: Path, cpu_offload_gb: float) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", cpu_offload_gb=cpu_offload_gb, **KWARGS)
    model, offload = llm.engine.runner.model, llm.engine.runner.offload
    assert offload is not None
    budget = int(cpu_offload_gb * GiB)
    order = [(name, tensor) for i, layer in enumerate(model.layers)
             for name, tensor in layer_weight_tensors(layer, f"layers.{i}")]
    count = len(offload.tensors)
    # a prefix of the layers' tensors in order, each whole, within the budget; the next one
    # would have taken the total past it
    assert [t.name for t in offload.tensors] == [name for name, _ in order[:count]]
    assert all(t.tensor is tensor for t, (_, tensor) in zip(offload.tensors, order[:count],
                                                             strict=True))
    assert all(t.host.shape == t.tensor.shape for t in offload.tensors)
    assert 0 < offload.offloaded_bytes <= budget
    assert offload.offloaded_bytes + tensor_bytes(order[count][1]) > budget
    assert offload.next_tensor == (order[count][0], tensor_bytes(order[count][1]))
    # only the offloaded layers are wrapped
    assert set(offload.layers) == {int(t.name.split(".")[1]) for t in offload.tensors}


def test_budget_below_the_first_tensor_offloads_nothing(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", cpu_offload_gb=1e-9, **KWARGS)
    offload = llm.engine.runner.offload
    assert offload is not None and offload.tensors == [] and offload.layers == {}
    assert llm.engine.runner.offloaded_bytes() == 0


def test_no_offloaded_weight_is_resident_between_steps(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", cpu_offload_gb=ALL_GB, **KWARGS)
    offload = llm.engine.runner.offload
    assert offload is not None
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    norm = layer.input_layernorm
    host = next(t.host for t in offload.tensors if t.tensor is norm.weight)
    during: list[tuple[int, bool]] = []
    wrapped = offload.layers[0]
    forward = wrapped.forward

    def probe(*args: Any, **kwargs: Any) -> Any:  # layer 0's own forward, copies swapped in
        during.append((offload.live_copies(), norm.weight.data_ptr() == host.data_ptr()))
        return forward(*args, **kwargs)

    wrapped.forward = probe
    try:
        for _ in range(2):
            outputs(llm)
            assert offload.live_copies() == 0
            for t in offload.tensors:  # every tensor points at its host copy again
                if not t.tensor.is_mkldnn:  # oneDNN's opaque tensors have no data pointer
                    assert t.tensor.data_ptr() == t.host.data_ptr()
    finally:
        wrapped.forward = forward
    layer0 = [t for t in offload.tensors if t.name.startswith("layers.0.")]
    assert during and all(live == len(layer0) and not on_host for live, on_host in during)
    # host copies are separate storages, not the working ones: the copies are fresh per call
    assert offload.num_copies >= 2 * len(offload.tensors)


def test_capacity_lines_and_describe_count_the_offloaded_bytes(
        tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    full = LLM(str(tiny_llama_dir), dtype="float32", **KWARGS).engine.describe()
    caplog.set_level(logging.INFO, logger="kvserve")
    llm = LLM(str(tiny_llama_dir), dtype="float32", cpu_offload_gb=PART_GB, **KWARGS)
    info, runner = llm.engine.describe(), llm.engine.runner
    offloaded = runner.offloaded_bytes()
    assert offloaded > 0 and info["offloaded_weight_bytes"] == offloaded
    assert info["cpu_offload_gb"] == PART_GB and full["offloaded_weight_bytes"] == 0
    assert info["weight_bytes"] == full["weight_bytes"] - offloaded
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("CPU offload: 7 of 12 decoder-layer weight tensors") and
               "layers 0-1, the last in part" in m for m in messages)
    assert any(m.startswith("Model weights on CPU:") and "CPU offload" in m for m in messages)
    plan = make_kv_cache_plan(llm.engine.model_config, "auto", torch.float32, 16, 10 * GiB)
    lines = capacity_log_lines(plan, torch.device("cuda"), 256, weight_bytes=3 * GiB,
                               offloaded_bytes=2 * GiB)
    assert lines[3] == ("Model weights on GPU: 3.00 GiB, CPU offload (--cpu-offload-gb): 2.00 "
                        "GiB in CPU memory, not counted against the KV budget")
    assert len(capacity_log_lines(plan, torch.device("cuda"), 256)) == 3


def test_plan_walks_the_layers_as_serve_does(tiny_qwen2_dir: Path) -> None:
    cfg = ModelConfig.from_folder(tiny_qwen2_dir)
    llm = LLM(str(tiny_qwen2_dir), dtype="float32", **KWARGS)
    served = [tensor_bytes(t) for _, t in layer_weight_tensors(llm.engine.runner.model.layers[0],
                                                                 "layers.0")]
    assert served == planned_layer_tensor_bytes(cfg, "none", torch.float32)
    for method in ("none", "int8", "int4"):  # the layers' share of the plan's weight bytes
        no_layers = dataclasses.replace(cfg, num_hidden_layers=0)
        layers = quantized_weight_bytes(cfg, method, torch.bfloat16) - \
            quantized_weight_bytes(no_layers, method, torch.bfloat16)
        assert layers == cfg.num_hidden_layers * sum(
            planned_layer_tensor_bytes(cfg, method, torch.bfloat16))


def test_plan_frees_the_offloaded_bytes_for_the_kv_cache(tiny_llama_dir: Path) -> None:
    base = EngineArgs(model=str(tiny_llama_dir), dtype="bfloat16")
    plain = build_plan(base, 2 * GiB)
    report = build_plan(dataclasses.replace(base, cpu_offload_gb=0.00005), 2 * GiB)
    sizes = planned_layer_tensor_bytes(report.model_config, "auto", torch.bfloat16) * 2
    count = count_within_budget(sizes, budget_bytes(0.00005))
    assert 0 < count < len(sizes) and report.offloaded_bytes == sum(sizes[:count])
    assert report.kv_plan.available_bytes == plain.kv_plan.available_bytes + \
        report.offloaded_bytes
    text = format_plan(report)
    assert "  CPU offload " in text and "--cpu-offload-gb 5e-05" in text
    assert "Model weights on GPU:" in text and "CPU offload" not in format_plan(plain)


@pytest.mark.parametrize("value", [-1.0, -1e-9, math.nan, math.inf])
def test_bad_values_are_refused_naming_the_flag(value: float) -> None:
    with pytest.raises(ValueError, match=r"--cpu-offload-gb"):
        EngineArgs.from_kwargs(None, cpu_offload_gb=value)


def test_cli_flag_parses_and_a_bad_value_exits_2(tiny_llama_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("serve", "generate", "plan"):
        ns = build_parser().parse_args([command, str(tiny_llama_dir), "--cpu-offload-gb", "2.5"])
        assert engine_args_from_flags(ns, command).cpu_offload_gb == 2.5
    ns = build_parser().parse_args(["serve", str(tiny_llama_dir)])
    assert engine_args_from_flags(ns, "serve").cpu_offload_gb == 0
    assert main(["serve", str(tiny_llama_dir), "--cpu-offload-gb", "-2"]) == 2
    assert "--cpu-offload-gb" in capsys.readouterr().err
    for command in ("serve", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--cpu-offload-gb CPU_OFFLOAD_GB" in capsys.readouterr().out


def test_cuda_graphs_are_off_with_offload() -> None:
    runner = object.__new__(ModelRunner)
    runner.device = torch.device("cuda")
    runner.args = EngineArgs()
    runner.parallel, runner.stage = None, None
    runner.backend = SimpleNamespace(supports_cuda_graphs=True)  # type: ignore[assignment]
    runner.offload = None
    assert runner.uses_cuda_graphs
    runner.offload = object()  # type: ignore[assignment]
    assert not runner.uses_cuda_graphs
