"""GGUF block types for the tests: re-encoding a GGUF file's matrices in other types, with
plain K-quant encoders (the `gguf` package quantizes Q4/Q5/Q8 blocks but not K-quants; its
dequantizer, independent of kvserve's reader, is the oracle for the bytes made here).

The encoders aim at valid, reasonable blocks, not at llama.cpp's error-minimizing search."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

T = GGMLQuantizationType


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [n, 8] -> the 12 packed bytes of a Q4_K/Q5_K super-block."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    out[:, 4:8] = mn[:, :4] | (mn[:, 4:] >> 4) << 6
    out[:, 8:12] = (sc[:, 4:] & 0xF) | (mn[:, 4:] & 0xF) << 4
    return out


def _k_quantize(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """w [n, 256] -> (d, dmin [n], 6-bit scales and mins [n, 8], codes [n, 256])."""
    sub = w.reshape(-1, 8, 32)
    lo = np.maximum(-sub.min(axis=2), 0.0)  # the min as a positive amount below zero
    scale = (sub.max(axis=2) + lo) / levels
    d = (scale.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (lo.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.maximum(d[:, None], 1e-30)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(lo / np.maximum(dmin[:, None], 1e-30)), 0, 63).astype(np.uint8)
    step = np.maximum(d[:, None] * sc, 1e-30)[..., None]
    q = np.round((sub + (dmin[:, None] * mn)[..., None]) / step)
    q = np.where(sc[..., None] > 0, np.clip(q, 0, levels), 0).astype(np.uint8)
    return d, dmin, sc, mn, q.reshape(-1, 256)


def _k_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 256] codes -> 128 bytes: run j's low nibbles sub-block 2j, high ones 2j + 1."""
    subs = q.reshape(-1, 4, 2, 32) & 0xF
    return (subs[:, :, 0] | subs[:, :, 1] << 4).reshape(-1, 128)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_quantize(w.reshape(-1, 256), 15)
    return np.concatenate((_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn),
                           _k_nibbles(q)), axis=1)


def encode_q5_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_quantize(w.reshape(-1, 256), 31)
    bits = (q.reshape(-1, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = bits.sum(axis=1).astype(np.uint8)  # byte l: bit s is sub-block s's item l
    return np.concatenate((_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn), qh,
                           _k_nibbles(q)), axis=1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    runs = w.reshape(-1, 16, 16)
    amax = np.abs(runs).max(axis=2) / 32  # each run's step at full range
    d = (amax.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(amax / np.maximum(d[:, None], 1e-30)), -128, 127).astype(np.int8)
    step = np.maximum(d[:, None] * sc, 1e-30)[..., None]
    q = np.where(sc[..., None] > 0, np.clip(np.round(runs / step) + 32, 0, 63), 32)
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, half, i, l]: item 32 i + l of the half
    ql = np.stack((q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4,
                   q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4), axis=2).reshape(-1, 128)
    high = q >> 4
    qh = (high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6)
    return np.concatenate((ql, qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)), axis=1)


K_ENCODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    T.Q4_K: encode_q4_k, T.Q5_K: encode_q5_k, T.Q6_K: encode_q6_k}


def encode(values: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """Float32 [rows, cols] -> the blocks of `kind` as uint8 [rows, bytes per row]."""
    if kind in K_ENCODERS:
        return K_ENCODERS[kind](values).reshape(values.shape[0], -1)
    return quantize(values, kind)


def reencode_gguf(src: Path, dst: Path,
                  kind_of: Callable[[str], GGMLQuantizationType | None]) -> Path:
    """A copy of GGUF `src` whose tensors `kind_of` names a type are stored in that type
    (from the file's own values); the rest, and every metadata key, as they are."""
    reader = GGUFReader(str(src))
    writer = GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        kind = kind_of(tensor.name)
        if kind is None or kind == tensor.tensor_type:
            if tensor.tensor_type in (T.F32, T.F16):
                writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape(
                    tuple(reversed(tensor.shape.tolist()))))
            else:
                writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
            continue
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if kind in (T.F32, T.F16):
            writer.add_tensor(tensor.name, values.astype(np.float32 if kind == T.F32
                                                         else np.float16))
        else:
            writer.add_tensor(tensor.name, encode(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
