"""engine/gguf_format.py against gguf's own reader and gguf.quants, plus synthetic files.

The synthetic files cover layouts the embedded model does not: qwen2, untied output, biases,
rope scaling, other quantization types, every metadata value type, damaged files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.model_loader.gguf.format import GGUFArray, dequantize_raw, read_gguf_header
from engine.model_loader.gguf.weights import iter_gguf_weights, read_gguf_config
from tests.support.gguf_helpers import tiny_layer_tensors, write_gguf

Q = GGMLQuantizationType


# --- synthetic files: layouts the embedded model does not cover ---------------------------


def test_qwen2_config_and_unpermuted_weights(tmp_path: Path) -> None:
    tensors = tiny_layer_tensors(with_bias=True)
    path = write_gguf(tmp_path / "qwen.gguf", "qwen2", tensors,
                      {"add_eos_token_id": 7, "add_eot_token_id": 9})
    cfg = read_gguf_config(path)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias is True
    assert cfg.vocab_size == 11  # from the token list: no qwen2.vocab_size key
    assert cfg.head_dim == 8 and cfg.num_key_value_heads == 1
    assert cfg.rope_theta == 10000.0 and cfg.eos_token_ids == (7, 9)
    weights = dict(iter_gguf_weights(path))
    # llama.cpp permutes only Llama-family Q/K, so qwen2 tensors must come back untouched.
    q_bias = torch.from_numpy(tensors["blk.1.attn_q.bias"])
    assert torch.equal(weights["model.layers.1.self_attn.q_proj.bias"], q_bias)
    k_weight = torch.from_numpy(tensors["blk.0.attn_k.weight"])
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], k_weight)


def test_llama_untied_output_and_permuted_bias(tmp_path: Path) -> None:
    tensors = tiny_layer_tensors(with_bias=True)
    tensors["output.weight"] = np.ones((11, 16), dtype=np.float32)
    path = write_gguf(tmp_path / "llama.gguf", "llama", tensors)
    cfg = read_gguf_config(path)
    assert cfg.tie_word_embeddings is False and cfg.attention_bias is True
    weights = dict(iter_gguf_weights(path))
    assert weights["lm_head.weight"].shape == (11, 16)
    # head_dim 8: HF row j*4 + i sits at GGUF row 2i + j, so HF's head reads GGUF rows
    # [0, 2, 4, 6, 1, 3, 5, 7] (the forward map would be [0, 4, 1, 5, ...]).
    q_bias = tensors["blk.0.attn_q.bias"]
    head = [0, 2, 4, 6, 1, 3, 5, 7]
    expected = torch.from_numpy(q_bias[head + [8 + r for r in head]])
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.bias"], expected)


def test_weights_convert_to_requested_dtype(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bf16.gguf", "llama", tiny_layer_tensors(False))
    weights = dict(iter_gguf_weights(path, dtype=torch.bfloat16))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert weights["model.embed_tokens.weight"].shape == (11, 16)


def test_linear_rope_scaling_from_metadata(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "linear.gguf", "llama", tiny_layer_tensors(False), {
        "add_rope_scaling_type": RopeScalingType.LINEAR, "add_rope_scaling_factor": 4.0})
    assert read_gguf_config(path).rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gemma.gguf", "gemma", tiny_layer_tensors(False))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        read_gguf_config(path)


def _llama3_inv_freq(head_dim: int, theta: float, params: dict[str, Any]) -> torch.Tensor:
    """transformers' own llama3 RoPE frequencies for the given rope parameters."""
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                         rope_parameters={"rope_type": "llama3", "rope_theta": theta, **params})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return inv_freq


@pytest.mark.parametrize("factor, low, high", [(8.0, 1.0, 4.0), (32.0, 1.0, 4.0),
                                               (16.0, 2.0, 8.0)])
def test_llama3_rope_freqs_tensor_becomes_rope_scaling(tmp_path: Path, factor: float,
                                                       low: float, high: float) -> None:
    head_dim, theta = 128, 500000.0
    truth = {"factor": factor, "low_freq_factor": low, "high_freq_factor": high,
             "original_max_position_embeddings": 8192}
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    divisors = (plain / _llama3_inv_freq(head_dim, theta, truth).double()).float().numpy()
    tensors = {**tiny_layer_tensors(False), "rope_freqs.weight": divisors}
    path = write_gguf(tmp_path / "llama3.gguf", "llama", tensors,
                      {"add_key_length": head_dim, "add_rope_freq_base": theta})
    scaling = read_gguf_config(path).rope_scaling
    assert scaling is not None and scaling.pop("rope_type") == "llama3"
    assert scaling == pytest.approx(truth, rel=1e-3)
    fitted = _llama3_inv_freq(head_dim, theta, scaling)
    assert torch.allclose(fitted, _llama3_inv_freq(head_dim, theta, truth), rtol=1e-4)
    assert "rope_freqs.weight" not in {name for name, _ in iter_gguf_weights(path)}


# --- the header parser and the dequantizer against gguf's reader and gguf.quants ---------


def test_header_matches_gguf_reader(model_path: Path, gguf_reader: GGUFReader) -> None:
    header = read_gguf_header(model_path)
    keys = [k for k in gguf_reader.fields if not k.startswith("GGUF.")]
    assert list(header.metadata) == keys
    for key in keys:
        field, value = gguf_reader.fields[key], header.metadata[key]
        if isinstance(value, GGUFArray):
            assert (value.item_type, value.count) == (field.types[-1], len(field.data)), key
        else:
            assert value == field.contents() and type(value) is type(field.contents()), key
    assert header.metadata["tokenizer.ggml.tokens"] == GGUFArray(GGUFValueType.STRING, 49152)
    ours = [(t.name, t.tensor_type, t.shape, t.offset, t.num_bytes) for t in header.tensors]
    theirs = [(t.name, t.tensor_type, tuple(reversed(t.shape.tolist())), t.data_offset,
               int(t.n_bytes)) for t in gguf_reader.tensors]
    assert ours == theirs


def test_dequantizer_equals_gguf_on_every_tensor(gguf_reader: GGUFReader) -> None:
    """Bit-identical to gguf.quants on all 272 tensors of the embedded file."""
    for tensor in gguf_reader.tensors:
        shape = tuple(reversed(tensor.shape.tolist()))
        raw = torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(-1))
        expected = np.array(dequantize(tensor.data, tensor.tensor_type)).reshape(shape)
        ours = dequantize_raw(raw, tensor.tensor_type, shape)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, torch.from_numpy(expected)), tensor.name
    assert {t.tensor_type for t in gguf_reader.tensors} == {Q.F32, Q.Q8_0, Q.Q4_1}


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.Q5_0, Q.BF16])
def test_quantized_weights_equal_gguf(tmp_path: Path, kind: GGMLQuantizationType) -> None:
    """Types the embedded file lacks: Q4_0, F16, and gguf's numpy fallback (Q5_0, BF16)."""
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((40, 96)) * rng.uniform(0.01, 10, (40, 1))).astype(np.float32)
    values[0] = 0.0  # zero scale
    values[1, :32] = 7.0  # a constant block: zero range for Q4_1
    stored = quantize(values, kind)
    path = write_gguf(tmp_path / "q.gguf", "qwen2", tiny_layer_tensors(False),
                      raw_tensors={"blk.0.ffn_up.weight": (stored, kind)})
    weights = dict(iter_gguf_weights(path))
    expected = torch.from_numpy(np.array(dequantize(stored, kind)))
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"], expected)
    assert read_gguf_header(path).tensors[-1].tensor_type == kind


def test_header_reads_every_value_type_and_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_int8("x.int8", -5)
    writer.add_uint16("x.uint16", 60000)
    writer.add_int64("x.int64", -(2**40))
    writer.add_float64("x.float64", 0.1)
    writer.add_bool("x.bool", True)
    writer.add_custom_alignment(64)
    writer.add_array("x.nested", [[1, 2], [3, 4, 5]])
    writer.add_array("x.strings", ["a", "bc", ""])
    writer.add_string("x.after", "still in step")
    writer.add_tensor("a.weight", np.arange(3, dtype=np.float32))
    writer.add_tensor("b.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                  writer.write_tensors_to_file, writer.close):
        write()
    header = read_gguf_header(path)
    meta = header.metadata
    assert (meta["x.int8"], meta["x.uint16"], meta["x.int64"]) == (-5, 60000, -(2**40))
    assert meta["x.float64"] == 0.1 and meta["x.bool"] is True
    assert meta["x.nested"] == GGUFArray(GGUFValueType.ARRAY, 2)
    assert meta["x.strings"] == GGUFArray(GGUFValueType.STRING, 3)
    assert meta["x.after"] == "still in step" and meta["general.alignment"] == 64
    assert [t.offset % 64 for t in header.tensors] == [0, 0]
    with path.open("rb") as f:
        f.seek(header.tensors[1].offset)
        assert np.frombuffer(f.read(24), dtype=np.float32).tolist() == list(range(6))
    assert header.tensors[1].shape == (2, 3)


def test_truncated_or_unknown_version_files_are_rejected(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "ok.gguf", "llama", tiny_layer_tensors(False))
    data = path.read_bytes()
    data_end = max(t.offset + t.num_bytes for t in read_gguf_header(path).tensors)
    for cut in (30, 200, data_end - 1):  # in the counts, in the metadata, in the last tensor
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="is not a readable GGUF file"):
            read_gguf_config(bad)
    old = tmp_path / "v1.gguf"
    old.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_gguf_config(old)
