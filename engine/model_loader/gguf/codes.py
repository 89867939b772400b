"""A GGUF file's quantized blocks as integer codes, for `--quantization gguf` (the in-place
default): each decoder matrix keeps its codes with a scale and a min per group of 32 inputs.

- Q4_0, Q4_1: 32 weights of one row, an fp16 scale d (Q4_1: an fp16 min m) and 16 bytes of
  nibbles (items 0-15 low, 16-31 high): d (q - 8) and d q + m are the int4 method's
  (q - 8) x scale + offset with scale d and offset 0 or 8 d + m, exactly.
- Q8_0: an fp16 d and 32 signed bytes c, w = d c: 8-bit codes q = c + 128 with min -128 d.
- Q5_0, Q5_1: as Q4 with a fifth bit per weight (4 bytes of high bits): 5-bit codes, min
  -16 d or m.
- Q4_K, Q5_K: super-blocks of 256 weights, an fp16 d and dmin, and per sub-block of 32 a 6-bit
  scale sc and min mn (12 bytes): w = d sc q - dmin mn, q of 4 (Q4_K) or 5 bits (Q5_K):
  scale d sc and min -dmin mn per group of 32, the codes kept.
- Q6_K: super-blocks of 256, 6-bit codes, an fp16 d and a signed 8-bit scale per 16 weights:
  w = d sc (q - 32). Two scales per 32 inputs are more than a group holds, so these weights
  are requantized to 8-bit codes per group of 32 (symmetric, scale max |w| / 127; each error
  at most 1/8 of the file's own step); every other type keeps its file codes.

Scales and mins go to the kernels in float16: exact for the Q4/Q5/Q8 blocks' own fp16 values,
rounded by at most 2^-11 of themselves for a K-quant's d sc products. Other types (F16, F32,
Q2_K, Q3_K, ...) are not read here: those matrices load as floats.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.quantization.checkpoint import LayerCodes

T = GGMLQuantizationType
GGUF_GROUP = 32

Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [n, 32], scales, mins [n]


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at bytes [start, start + 2) of each block, as float32 [n]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()[:, 0]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] codes: low nibbles are items 0-15, high ones 16-31."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1).to(torch.int32)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes -> [n, 32] bits: bit j of the little-endian word is item j's."""
    word = qh.to(torch.int64)
    word = word[:, 0] | word[:, 1] << 8 | word[:, 2] << 16 | word[:, 3] << 24
    return ((word[:, None] >> torch.arange(32)) & 1).to(torch.int32)


def _q4_0(b: torch.Tensor) -> Blocks:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:]), d, -8.0 * d


def _q4_1(b: torch.Tensor) -> Blocks:
    return _nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2)


def _q8_0(b: torch.Tensor) -> Blocks:
    d = _f16(b, 0)
    return b[:, 2:].view(torch.int8).to(torch.int32) + 128, d, -128.0 * d


def _q5_0(b: torch.Tensor) -> Blocks:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6]) << 4, d, -16.0 * d


def _q5_1(b: torch.Tensor) -> Blocks:
    return _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8]) << 4, _f16(b, 0), _f16(b, 2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 12] bytes -> the 8 sub-blocks' 6-bit scales and mins, [n, 8] each: sub-blocks 0-3
    in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11,
    their top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    q = packed.to(torch.int32)
    low_sc, low_mn = q[:, 0:4] & 63, q[:, 4:8] & 63
    high_sc = (q[:, 8:12] & 0x0F) | (q[:, 0:4] >> 6) << 4
    high_mn = (q[:, 8:12] >> 4) | (q[:, 4:8] >> 6) << 4
    return torch.cat((low_sc, high_sc), 1), torch.cat((low_mn, high_mn), 1)


def _k_blocks(b: torch.Tensor, codes: torch.Tensor) -> Blocks:
    """A Q4_K/Q5_K super-block's codes [n, 256] and scales into 8 groups of 32 each."""
    sc, mn = _k_scales(b[:, 4:16])
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales = d[:, None] * sc.float()
    mins = -(dmin[:, None] * mn.float())
    return codes.reshape(-1, GGUF_GROUP), scales.reshape(-1), mins.reshape(-1)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes in 4 runs of 32 -> [n, 256]: run j's low nibbles are sub-block 2j, its
    high ones 2j + 1."""
    runs = qs.reshape(qs.shape[0], 4, 1, 32)
    return torch.cat((runs & 0x0F, runs >> 4), dim=2).reshape(qs.shape[0], 256).to(torch.int32)


def _q4_k(b: torch.Tensor) -> Blocks:
    return _k_blocks(b, _k_nibbles(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> Blocks:
    qh = b[:, 16:48].to(torch.int32)  # byte l holds bit 2j of sub-block 2j's item l, 2j+1 next
    high = (qh[:, None, :] >> torch.arange(8)[None, :, None]) & 1  # [n, 8 sub-blocks, 32]
    return _k_blocks(b, _k_nibbles(b[:, 48:176]) | high.reshape(-1, 256) << 4)


def _q6_k_values(b: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [n, 210] -> float32 [n, 256]. Each half of 128 weights reads 64 bytes
    of low nibbles ql and 32 of high pairs qh; item l + 32 i of the half (i = 0..3) takes
    ql[l] (i = 0, 2) or ql[l + 32] (i = 1, 3), low nibble for i < 2, and bits 2i, 2i + 1 of
    qh[l]; scale 16-item run k of the super-block: int8 scales[k]."""
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32).to(torch.int32)  # [n, half, ql[l] / ql[l+32], l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32).to(torch.int32)
    low = torch.stack((ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4),
                      dim=2)  # [n, half, i, l]
    high = (qh >> (2 * torch.arange(4)[None, None, :, None])) & 3
    q = (low | high << 4) - 32
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _f16(b, 208)
    values = q.reshape(n, 16, 16).float() * (d[:, None] * sc)[..., None]
    return values.reshape(n, 256)


def _q6_k(b: torch.Tensor) -> Blocks:
    w = _q6_k_values(b).reshape(-1, GGUF_GROUP)
    scales = (w.abs().amax(dim=1) / 127.0).half().float()
    codes = torch.where(scales[:, None] > 0, w / scales.clamp(min=1e-30)[:, None],
                        torch.zeros_like(w)).round().clamp(-127, 127)
    return codes.to(torch.int32) + 128, scales, -128.0 * scales


# (decoder, code bits) per type; Q6_K's codes are made here (see the module docstring).
_DECODERS: dict[GGMLQuantizationType, tuple[Callable[[torch.Tensor], Blocks], int]] = {
    T.Q4_0: (_q4_0, 4), T.Q4_1: (_q4_1, 4), T.Q4_K: (_q4_k, 4),
    T.Q8_0: (_q8_0, 8), T.Q5_0: (_q5_0, 5), T.Q5_1: (_q5_1, 5), T.Q5_K: (_q5_k, 5),
    T.Q6_K: (_q6_k, 8),
}
CODE_TYPES = tuple(_DECODERS)
# 6-bit codes requantized to 8 bits (not the file's own codes)
REQUANTIZED_TYPES = (T.Q6_K,)


def layer_codes(raw: torch.Tensor, kind: GGMLQuantizationType,
                shape: tuple[int, ...]) -> LayerCodes | None:
    """The codes of a quantized matrix of numpy shape [out, in] (uint8 bytes `raw`); None for
    types kept as floats."""
    if kind not in _DECODERS or len(shape) != 2:
        return None
    out_features, in_features = shape
    decode, bits = _DECODERS[kind]
    codes, scales, mins = decode(raw.view(-1, GGML_QUANT_SIZES[kind][1]))
    groups = in_features // GGUF_GROUP
    offsets = mins + 8.0 * scales if bits == 4 else mins
    return LayerCodes(codes.reshape(out_features, in_features),
                      scales.reshape(out_features, groups), offsets.reshape(out_features, groups),
                      bits=bits)


# A decoder matrix's GGUF name part -> its fused linear: qkv, o, gate_up, down.
_FUSED = {"attn_q": 0, "attn_k": 0, "attn_v": 0, "attn_output": 1, "ffn_gate": 2, "ffn_up": 2,
          "ffn_down": 3}
_MATRIX = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def linear_code_bits(tensors: Iterable[tuple[str, GGMLQuantizationType]],
                     num_layers: int) -> tuple[float, float, float, float] | None:
    """The mean code width (bits a weight, over the layers) of each fused linear (qkv, o,
    gate_up, down) as kvserve keeps a GGUF file's blocks in place: per layer the widest of its
    matrices' (4, 5 or 8). None where a decoder matrix is of a type that loads as floats."""
    bits = [[4] * num_layers for _ in range(4)]
    for name, kind in tensors:
        match = _MATRIX.fullmatch(name)
        if match is None or match.group(2) not in _FUSED:
            continue
        if kind not in _DECODERS:
            return None
        layer, fused = int(match.group(1)), _FUSED[match.group(2)]
        if layer < num_layers:
            bits[fused][layer] = max(bits[fused][layer], _DECODERS[kind][1])
    mean = [sum(b) / num_layers for b in bits]
    return mean[0], mean[1], mean[2], mean[3]

