"""The tiled weight layouts of kvserve's C++ quantized linears (kernels/cpu/quant/qgemm.cpp).

Weights come in tiles of 16 output rows: the 16 lanes of an AVX512-VNNI dot product are 16
rows, each summing 4 consecutive inputs, so a block of 32 inputs is 8 operands of 64 bytes.

- int4: block b of tile t is 256 bytes, 4 runs of 64; run j holds operand j in its low nibbles
  and operand j + 4 in its high ones; byte 4l + i of operand c is row l's input 32b + 4c + i.
  Scales and mins: [tiles, groups, 2, 16] (w = scale x q + min).
- int8: block b of tile t is its 8 operands of 64 bytes, [tiles, blocks x 512].
- 8-bit codes (a GGUF file's Q8_0 and Q6_K blocks): uint8 codes in the int8 layout, with
  int4's scales and mins (w = scale x q + min, q in 0..255).
- 5-bit codes (Q5_0, Q5_1, Q5_K): 320 bytes a block, the low 4 bits as int4's 256, then 8
  little-endian 64-bit words, word c bit i the fifth bit of operand c's byte i; int4's scales
  and mins.

`pack_*` turn codes [out, in] into a layout, `unpack_*` return them (the tests and
`dequantize` read weights back through them); a tied embedding reads single int8 rows with the
C++ op q8_embedding.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import cpu_ops

TILE_ROWS = 16
BLOCK = 32


def tile_ops() -> Any | None:
    """kvserve's C++ ops, whose tiled kernels run the int8 dot product on every ISA of their
    vector layer (AVX-512, AVX2, NEON), else None where they are not built (an unsupported
    CPU: torch's kernels and layouts are kept)."""
    ops = cpu_ops.load()
    return ops if ops is not None and ops.int8_dot_available() else None


def tiles_fit(out_features: int, in_features: int) -> bool:
    """Whether a weight [out, in] has a tiled layout (16 rows per tile, 32 inputs per block)."""
    return out_features % TILE_ROWS == 0 and in_features % BLOCK == 0


def _operands(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [tiles, blocks, 8 operands, 16 rows, 4 inputs]."""
    out_features, in_features = codes.shape
    tiles, blocks = out_features // TILE_ROWS, in_features // BLOCK
    return codes.reshape(tiles, TILE_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4)


def _from_operands(ops: torch.Tensor) -> torch.Tensor:
    """The inverse of `_operands`."""
    tiles, blocks = ops.shape[0], ops.shape[1]
    return ops.permute(0, 3, 1, 2, 4).reshape(tiles * TILE_ROWS, blocks * BLOCK)


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [out, in] in 0..15, scales and mins [out, groups] -> (qweight, scale_mins)."""
    _check_fit("int4", codes)
    ops = _operands(codes.to(torch.uint8))
    runs = ops[:, :, :4] | (ops[:, :, 4:] << 4)  # [tiles, blocks, 4, 16, 4]
    qweight = runs.reshape(codes.shape[0] // TILE_ROWS, -1).contiguous()
    return qweight, _scale_mins(scales, mins, dtype)


def _scale_mins(scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scales and mins [out, groups] -> [tiles, groups, 2, 16] in `dtype`."""
    groups = scales.shape[1]
    planes = torch.stack((scales, mins), dim=1).to(dtype)  # [out, 2, groups]
    return planes.reshape(-1, TILE_ROWS, 2, groups).permute(0, 3, 2, 1).contiguous()


def _split_scale_mins(scale_mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `_scale_mins`: (scales, mins) [out, groups]."""
    planes = scale_mins.permute(0, 3, 2, 1).reshape(scale_mins.shape[0] * TILE_ROWS, 2, -1)
    return planes[:, 0], planes[:, 1]


def _check_fit(kind: str, codes: torch.Tensor) -> None:
    out_features, in_features = codes.shape
    if not tiles_fit(out_features, in_features):
        raise ValueError(f"an {kind} tile layout needs out % {TILE_ROWS} and in % {BLOCK} == 0, "
                         f"got [{out_features}, {in_features}]")


def pack_u8(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [out, in] in 0..255, scales and mins [out, groups] -> (qweight, scale_mins)."""
    _check_fit("8-bit", codes)
    qweight = _operands(codes.to(torch.uint8)).reshape(codes.shape[0] // TILE_ROWS, -1)
    return qweight.contiguous(), _scale_mins(scales, mins, dtype)


def unpack_u8(qweight: torch.Tensor, scale_mins: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scale_mins) -> codes [out, in] int32, scales and mins [out, groups]."""
    ops = qweight.reshape(qweight.shape[0], -1, 8, TILE_ROWS, 4)
    return (_from_operands(ops).to(torch.int32), *_split_scale_mins(scale_mins))


def pack_u5(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [out, in] in 0..31, scales and mins [out, groups] -> (qweight, scale_mins)."""
    _check_fit("5-bit", codes)
    ops = _operands(codes.to(torch.uint8))  # [tiles, blocks, 8, 16, 4]
    low = ops & 0xF
    runs = low[:, :, :4] | (low[:, :, 4:] << 4)  # [tiles, blocks, 4, 16, 4]
    tiles, blocks = ops.shape[:2]
    fifth = (ops >> 4).reshape(tiles, blocks, 8, 8, 8)  # operand, byte of the word, bit
    words = (fifth << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    block = torch.cat((runs.reshape(tiles, blocks, 256), words.reshape(tiles, blocks, 64)), -1)
    return block.reshape(tiles, -1).contiguous(), _scale_mins(scales, mins, dtype)


def unpack_u5(qweight: torch.Tensor, scale_mins: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scale_mins) -> codes [out, in] int32, scales and mins [out, groups]."""
    tiles = qweight.shape[0]
    block = qweight.reshape(tiles, -1, 320)
    runs = block[..., :256].reshape(tiles, -1, 4, TILE_ROWS, 4)
    low = torch.cat((runs & 0xF, runs >> 4), dim=2)  # [tiles, blocks, 8, 16, 4]
    words = block[..., 256:].reshape(tiles, -1, 8, 8, 1)
    fifth = (words >> torch.arange(8, dtype=torch.uint8)) & 1  # [.., operand, byte, bit]
    ops = low | (fifth.reshape(low.shape) << 4)
    return (_from_operands(ops).to(torch.int32), *_split_scale_mins(scale_mins))


def unpack_int4(qweight: torch.Tensor, scale_mins: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scale_mins) -> codes [out, in] int32, scales and mins [out, groups]."""
    tiles = qweight.shape[0]
    runs = qweight.reshape(tiles, -1, 4, TILE_ROWS, 4)
    ops = torch.cat((runs & 0xF, runs >> 4), dim=2)
    return (_from_operands(ops).to(torch.int32), *_split_scale_mins(scale_mins))


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] -> the tiled layout [tiles, blocks x 512]."""
    _check_fit("int8", codes)
    return _operands(codes).reshape(codes.shape[0] // TILE_ROWS, -1).contiguous()


def unpack_int8(qweight: torch.Tensor) -> torch.Tensor:
    """The tiled layout -> int8 codes [out, in]."""
    return _from_operands(qweight.reshape(qweight.shape[0], -1, 8, TILE_ROWS, 4))
