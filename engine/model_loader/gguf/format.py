"""The GGUF binary format: a fast header reader and a torch dequantizer.

gguf's GGUFReader decodes every metadata string up front (49k tokens and 49k merges, ~4 s for
SmolLM2), so the header is parsed by `read_gguf_header`, which only walks past arrays.
Q4_0/Q4_1/Q8_0 are dequantized with torch ops (gguf's numpy path loops over row groups). What
the tensors mean to a model is engine.gguf_loader's business.
"""

from __future__ import annotations

import io
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what gguf's own reader accepts; v1 used 32-bit counts
GGUF_DEFAULT_ALIGNMENT = 32
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


def is_gguf_file(path: str | Path) -> bool:
    """True when `path` is a file starting with the GGUF magic; the suffix is not consulted."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def read_gguf_header(path: str | Path) -> GGUFFile:
    """Parses a GGUF file's metadata and tensor directory (GGUF spec v2/v3, little-endian).

    Arrays are walked past, not decoded, which makes this ~200x faster than gguf's
    GGUFReader on a file with a 50k-token vocabulary. ValueError for anything unreadable.
    """
    path = Path(path)
    check_gguf_file(path)
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(path, buf)
    except (ValueError, struct.error) as e:  # truncated, corrupt or newer-version files
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def check_gguf_file(path: Path) -> None:
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


def read_raw(f: io.BufferedReader, tensor: GGUFTensorInfo) -> torch.Tensor:
    """One tensor's bytes as stored (uint8 [num_bytes]), in memory it owns."""
    raw = torch.empty(tensor.num_bytes, dtype=torch.uint8)  # [num_bytes]
    f.seek(tensor.offset)
    if f.readinto(raw.numpy().data) != tensor.num_bytes:
        raise ValueError(f"GGUF tensor {tensor.name} is truncated")
    return raw


def read_tensor(f: io.BufferedReader, tensor: GGUFTensorInfo) -> torch.Tensor:
    """One tensor dequantized to float32 in numpy order ([out, in]), in memory it owns."""
    return dequantize_raw(read_raw(f, tensor), tensor.tensor_type, tensor.shape)


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
