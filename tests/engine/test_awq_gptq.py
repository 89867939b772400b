"""AWQ and GPTQ checkpoints: built here from known 4-bit codes (tests/support/
quantized_checkpoints.py), loaded through the int4 method with their codes kept exactly, and
compared with the float checkpoint the codes stand for (the independent reference)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams, cpu_features
from engine.config import EngineArgs, ModelConfig
from engine.planner import build_plan
from engine.quantization import Int4Method, QuantizedLinear, quantized_weight_bytes, tiles
from tests.support.greedy import logprob_agreement, tokens_and_logprobs
from tests.support.quantized_checkpoints import write_quantized
from tests.support.tiny_models import build_tiny_model, random_prompts

PROMPTS = random_prompts(512, 4, 6, 30, seed=11)
MAX_TOKENS = 8


def _greedy(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    return tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                            use_tqdm=False))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("awq_gptq_src")
    return {arch: build_tiny_model(root / arch, arch, seed=5, init_std=0.05)
            for arch in ("llama", "qwen2")}


CASES = {
    "awq llama": ("llama", "awq", {}),
    "awq qwen2 (biases)": ("qwen2", "awq", {}),
    "gptq asym v1": ("llama", "gptq", {}),
    "gptq sym v1": ("llama", "gptq", {"sym": True}),
    "gptq v2": ("llama", "gptq", {"v2": True}),
    "gptq group 64": ("llama", "gptq", {"group": 64}),
}


@pytest.mark.parametrize("case, dtype", [(case, "float32") for case in CASES] +
                         [("awq llama", "bfloat16"), ("gptq asym v1", "bfloat16")])
def test_checkpoint_codes_load_exactly_and_decode_like_their_float_weights(
        tiny_dirs: dict[str, Path], tmp_path: Path, case: str, dtype: str) -> None:
    """bfloat16 runs a fused int4 kernel; float32 (tests pin the CPU to one without native bf16)
    kvserve's tile kernels where they were built (AVX512-VNNI), else the dequantizing path:
    every path must hold the checkpoint's codes."""
    arch, method, options = CASES[case]
    quant_dir, ref_dir, codes = write_quantized(tiny_dirs[arch], tmp_path, method, **options)
    llm = LLM(str(quant_dir), dtype=dtype, num_threads=1, max_model_len=256)
    model = llm.engine.runner.model
    qkv = model.get_submodule("layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, QuantizedLinear) and isinstance(qkv.method, Int4Method)
    want = torch.cat([codes[f"model.layers.0.self_attn.{p}"] for p in ("q_proj", "k_proj",
                                                                        "v_proj")])
    assert torch.equal(qkv.method.unpack_codes(qkv.tensors()), want)  # the codes, untouched
    down = model.get_submodule("layers.1.mlp.down_proj")
    assert isinstance(down, QuantizedLinear)
    assert torch.equal(down.method.unpack_codes(down.tensors()),
                       codes["model.layers.1.mlp.down_proj"])
    ref_down = load_file(str(ref_dir / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    torch.testing.assert_close(down.dequantized_weight().float(), ref_down,
                               rtol=1e-2, atol=1e-3)  # scales kept in the compute dtype
    ref_llm = LLM(str(ref_dir), dtype=dtype, num_threads=1, max_model_len=256)
    assert qkv.fused == (dtype == "bfloat16" or tiles.tile_ops() is not None)
    assert not isinstance(model.lm_head, QuantizedLinear)  # as the checkpoint stores it
    agreed, mad, rule = logprob_agreement(_greedy(ref_llm), _greedy(llm))
    assert rule and mad <= 0.05 and agreed >= 0.5, (mad, agreed)


def test_act_order_is_requantized_with_a_warning(
        tiny_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    quant_dir, ref_dir, _ = write_quantized(tiny_dirs["llama"], tmp_path, "gptq",
                                            act_order=True)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        llm = LLM(str(quant_dir), dtype="float32", num_threads=1, max_model_len=256)
    assert "act-order groups are not contiguous" in caplog.text
    assert isinstance(llm.engine.runner.model.get_submodule("layers.0.mlp.down_proj"),
                      QuantizedLinear)
    ref_llm = LLM(str(ref_dir), dtype="float32", num_threads=1, max_model_len=256)
    _, mad, rule = logprob_agreement(_greedy(ref_llm), _greedy(llm))
    assert rule and mad <= 0.1, mad


def test_flags_that_contradict_the_checkpoint_are_refused(
        tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    quant_dir, ref_dir, _ = write_quantized(tiny_dirs["llama"], tmp_path, "awq")
    with pytest.raises(ValueError, match="already awq-quantized.*omit it or pass awq"):
        LLM(str(quant_dir), quantization="int8")
    with pytest.raises(ValueError, match="--quantization gptq needs a checkpoint quantized"):
        LLM(str(ref_dir), quantization="gptq")
    LLM(str(quant_dir), quantization="awq", dtype="float32", max_model_len=64)  # its own name


def test_unsupported_checkpoint_quantization_is_a_clear_error(
        tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    quant_dir, _, _ = write_quantized(tiny_dirs["llama"], tmp_path, "gptq")
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (quant_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="8-bit weights: kvserve loads 4-bit"):
        LLM(str(quant_dir), dtype="float32")


def test_plan_counts_the_resident_int4_bytes(tiny_dirs: dict[str, Path],
                                             tmp_path: Path) -> None:
    quant_dir, ref_dir, _ = write_quantized(tiny_dirs["llama"], tmp_path, "awq")
    cfg = ModelConfig.from_folder(quant_dir)
    assert cfg.checkpoint_quantization == ("awq", 32)
    resident = LLM(str(quant_dir), dtype="bfloat16",
                   max_model_len=64).engine.runner.weight_bytes()
    # On CPU the float LM head, tied to the embedding, is also held oneDNN-packed beside it,
    # where oneDNN packs bfloat16 (not on AVX2-only CPUs: there it is the embedding itself).
    packed_head = cfg.vocab_size * cfg.hidden_size * 2 \
        if cpu_features.onednn_linear_supports(torch.bfloat16) else 0
    predicted = quantized_weight_bytes(cfg, "none", torch.bfloat16)  # the checkpoint's method
    assert resident == predicted + packed_head
    assert predicted < quantized_weight_bytes(ModelConfig.from_folder(ref_dir), "none",
                                              torch.bfloat16)
    report = build_plan(EngineArgs(model=str(quant_dir), dtype="bfloat16"), 2 * 1024**3)
    assert report.weight_bytes == predicted
