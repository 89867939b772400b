"""`--quantization`: resident weight bytes against the formula `kvserve plan` uses, the plan's
KV budget, the command lines that take the flag, and a model in host memory quantized onto
its device (how a CUDA model loads)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from engine import LLM
from engine.config import EngineArgs, ModelConfig
from engine.planner import add_plan_arguments, build_plan, format_plan
from engine.quantization import QuantizedLinear, quantize_model, quantized_weight_bytes


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_weight_bytes_shrink_and_match_the_formula(
        request: pytest.FixtureRequest, model_fixture: str, dtype: str) -> None:
    folder = request.getfixturevalue(model_fixture)
    cfg = ModelConfig.from_folder(folder)
    torch_dtype = getattr(torch, dtype)
    sizes = {}
    for method in ("none", "int8", "int4"):
        llm = LLM(str(folder), dtype=dtype, quantization=method, num_threads=1,
                  max_model_len=256)
        sizes[method] = llm.engine.runner.weight_bytes()
        # Unquantized on CPU, a tied LM head is also held oneDNN-packed beside the embedding.
        packed_head = cfg.vocab_size * cfg.hidden_size * torch_dtype.itemsize \
            if method == "none" and cfg.tie_word_embeddings else 0
        assert sizes[method] == quantized_weight_bytes(cfg, method, torch_dtype) + packed_head
    assert sizes["int4"] < sizes["int8"] < sizes["none"]


def test_plan_uses_the_quantized_weight_bytes(tiny_llama_dir: Path) -> None:
    cfg = ModelConfig.from_folder(tiny_llama_dir)
    memory = 2 * 1024**3
    reports = {m: build_plan(EngineArgs(model=str(tiny_llama_dir), quantization=m), memory)
               for m in ("none", "int8", "int4")}
    for method, report in reports.items():
        assert report.weight_bytes == quantized_weight_bytes(cfg, method, torch.bfloat16)
    assert reports["int4"].weight_bytes < reports["int8"].weight_bytes < \
        reports["none"].weight_bytes
    freed = reports["none"].weight_bytes - reports["int4"].weight_bytes
    assert reports["int4"].kv_plan.available_bytes - reports["none"].kv_plan.available_bytes \
        == freed
    text = format_plan(reports["int4"])
    assert "--quantization int4" in text


def test_plan_command_line_takes_quantization(tiny_llama_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    ns = parser.parse_args([str(tiny_llama_dir), "--memory", "1GiB", "--quantization", "int8",
                            "--quantization-group-size", "32"])
    assert ns.quantization == "int8" and ns.quantization_group_size == 32


def test_bad_quantization_is_refused_naming_the_choices(tiny_llama_dir: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'fp4'; use one of auto, none, "
                                         "int8, int4, awq, gptq, gguf"):
        LLM(str(tiny_llama_dir), quantization="fp4")
    with pytest.raises(ValueError, match="quantization_group_size must be one of 32, 64, 128, "
                                         "256, got 48"):
        EngineArgs.from_kwargs(None, quantization="int4", quantization_group_size=48)
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp4"])
    err = capsys.readouterr().err
    assert "invalid choice: 'fp4'" in err and all(m in err for m in ("none", "int8", "int4"))
    # vLLM's None: as the checkpoint says (AWQ/GPTQ codes, a GGUF file's blocks), else none.
    assert EngineArgs.from_kwargs(None, quantization=None).quantization == "auto"


def test_command_line_generate_and_plan_take_quantization(
        tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from server.cli import main

    assert main(["generate", str(tiny_llama_dir), "--raw", "--prompt", "the cat sees",
                 "--max-tokens", "3", "--kv-cache-memory-bytes", str(2**20),
                 "--quantization", "int4", "--quantization-group-size", "32"]) == 0
    assert main(["plan", str(tiny_llama_dir), "--memory", "1GiB", "--quantization", "int8"]) == 0
    out = capsys.readouterr().out
    cfg = ModelConfig.from_folder(tiny_llama_dir)
    weights = quantized_weight_bytes(cfg, "int8", torch.bfloat16) / 1024**3
    assert f"{weights:.2f} GiB" in out and "--quantization int8 (codes and scales" in out
    with pytest.raises(SystemExit) as refused:
        main(["generate", str(tiny_llama_dir), "--quantization", "fp4"])
    assert refused.value.code == 2
    assert "invalid choice: 'fp4'" in capsys.readouterr().err


class _HostModel(nn.Module):
    """Two linears, a norm weight and an LM head tied to the embedding, in host memory."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 32, bias=False)])
        self.norm = nn.Parameter(torch.ones(32))
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_model_in_host_memory_is_quantized_onto_its_device(method: str) -> None:
    # A CUDA model with --quantization loads in host memory (ModelRunner._load_model): each
    # float weight goes to the device only to be quantized, so the device never holds the
    # float model. `meta` stands for the device here (shapes only, no GPU needed).
    model, meta = _HostModel(), torch.device("meta")
    floats = [layer.weight for layer in model.layers]
    quantize_model(model, method, torch.bfloat16, meta, group_size=32)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 3 and not any(isinstance(m, nn.Linear) for m in model.modules())
    for layer in layers:  # codes, scales and bias made on the device
        assert {t.device for t in layer.buffers()} == {meta}
    assert all(w.device.type == "cpu" for w in floats)  # the floats never moved over whole
    # the rest stays for the runner's place_on_device (a CPU-to-meta `.data` swap is not
    # allowed, a CPU-to-CUDA one is: engine/worker/offload.py)
    assert model.norm.device.type == "cpu"
    # Under --cpu-offload-gb the layers stay in host memory, planned for the device's kernels.
    offloaded = _HostModel()
    quantize_model(offloaded, method, torch.bfloat16, meta, group_size=32,
                   place=torch.device("cpu"))
    assert {t.device.type for t in offloaded.buffers()} == {"cpu"}
