"""`--quantization gguf`, the default for GGUF files where int4 runs fused: the embedded SmolLM2
file's Q4_1 blocks become the int4 layers' codes, checked against the `gguf` package's own
dequantization (an independent reader), never rounded onto a new grid."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from engine import LLM, SamplingParams, cpu_features
from engine.model_loader.gguf.weights import default_model_path
from engine.models.cpu_linear import PackedLinear
from engine.quantization import QuantizedLinear
from tests.support.greedy import logprob_agreement, tokens_and_logprobs


@pytest.fixture(scope="module")
def in_place() -> LLM:
    # bfloat16: torch's fused int4 CPU kernel takes it on any CPU, so `auto` keeps the blocks.
    return LLM(None, dtype="bfloat16", max_model_len=256, num_threads=2)


def _file_tensor(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The file's float values of `name` by the gguf package, and its Q4_1 d and m per block."""
    reader = GGUFReader(str(default_model_path()))
    tensor = next(t for t in reader.tensors if t.name == name)
    assert tensor.tensor_type.name == "Q4_1"
    values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
    blocks = torch.from_numpy(tensor.data.copy()).reshape(-1, 20)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()[:, 0]
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()[:, 0]
    return values, d, m


@pytest.mark.slow
def test_q4_blocks_become_the_layers_codes(in_place: LLM) -> None:
    layer = in_place.engine.runner.model.get_submodule("layers.3.mlp.down_proj")
    assert isinstance(layer, QuantizedLinear) and layer.fused
    values, d, m = _file_tensor("blk.3.ffn_down.weight")
    out_features, in_features = values.shape
    # Each weight's 4-bit code, from the gguf package's floats: q = (w - m) / d.
    blocks = values.reshape(-1, 32)
    want = ((blocks - m[:, None]) / d.clamp(min=1e-12)[:, None]).round().clamp(0, 15)
    codes = layer.method.unpack_codes(layer.tensors())
    assert torch.equal(codes, want.reshape(out_features, in_features).to(torch.int32))
    # Scales and offsets are kept in the kernel's bfloat16: values within that rounding.
    torch.testing.assert_close(layer.dequantized_weight().float(), values, rtol=0,
                               atol=float(d.abs().max()) / 8)


@pytest.mark.slow
def test_default_keeps_the_file_in_place_and_none_dequantizes(in_place: LLM) -> None:
    runner = in_place.engine.runner
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert runner.weight_bytes() < 100 * 2**20  # 90 MiB against 311 MiB dequantized
    dequantized = LLM(None, dtype="bfloat16", max_model_len=256, quantization="none")
    # oneDNN packs bfloat16 weights only where it can (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)
    assert (isinstance(dequantized.engine.runner.model.layers[0].self_attn.qkv_proj,
                       PackedLinear) == cpu_features.onednn_linear_supports(torch.bfloat16))
    # The same codes, but the in-place layers may quantize their activations to int8 per
    # block of 32 (the tiled kernels): greedy text is held to vLLM's check_logprobs_close rule
    # (where the runs part, each one's token is in the other's top 5), not to equality.
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    prompt = ["The capital of France is"]
    runs = [tokens_and_logprobs(llm.generate(prompt, params, use_tqdm=False))
            for llm in (dequantized, in_place)]
    agree, mad, rule = logprob_agreement(*runs)
    assert rule and mad <= 0.1 and agree >= 0.25, (agree, mad)


def test_gguf_needs_a_gguf_file(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--quantization gguf keeps a GGUF file's quantized"):
        LLM(str(tiny_llama_dir), quantization="gguf")


@pytest.mark.slow
def test_greedy_rows_take_the_argmax_of_the_heads_own_output(
        in_place: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten greedy prompts (more rows than the one-call decode step takes): their tokens are the
    argmax of the LM head's bfloat16 output (greedy_logits, never widened to float32), the same
    tokens as with logprobs asked (float32 logits through the sampler)."""
    from engine.models.llama import LlamaForCausalLM

    seen: list[torch.dtype] = []
    own = LlamaForCausalLM.greedy_logits

    def spy(self: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        out = own(self, hidden)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(LlamaForCausalLM, "greedy_logits", spy)
    prompts = [f"Item {i}: the" for i in range(10)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids)
              for o in in_place.generate(prompts, greedy, use_tqdm=False)]
    assert seen and set(seen) == {torch.bfloat16}
    asked = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    reference = tokens_and_logprobs(in_place.generate(prompts, asked, use_tqdm=False))
    assert tokens == [t for t, _ in reference]
