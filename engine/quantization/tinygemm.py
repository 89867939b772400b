"""torch's tinygemm int4 kernel on CUDA (`aten._weight_int4pack_mm`) for int4 layers.

gpt-fast and torchao run their int4 weight-only layers on it; it reads the codes in a tiled
int32 layout made for the tensor cores' m16n8k16 operand B and the same scale/zero convention
as kvserve's int4 (w = (q - 8) x scale + zero, [groups, out, 2]), with bfloat16 activations
and scales only. Where it fits, an int4 layer on CUDA keeps its codes in this layout
(`layout_tinygemm`) instead of the Triton kernel's input-major one: up to MAX_ROWS rows go
through tinygemm, more rows dequantize (kernels/triton_quant_linear.py,
`dequantize_tinygemm`) and run cuBLAS.

The layout, read from torch's packing kernel (`matrix_to_m16n8k16_Bint4_layout`, int4mm.cu):
int32 [out/8, in/(16 I), 32, I/2] for I = inner_k_tiles (2, 4 or 8). Element [nt, ko, t, s]
holds eight codes of output n = 8 nt + t // 4; its nibble j = 4 hl + 2 a + b (bits 4j..4j+3)
is the code of input k = 16 I ko + 32 s + 16 a + 8 b + 2 (t % 4) + hl. `pack` builds it with
torch ops on any device (a layer quantized in host memory too); `unavailable_reason` checks,
on the GPU, that torch's own packing gives the same int32s and that the product is right.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("kvserve")

# Rows up to which a tinygemm layer runs the kernel; more rows dequantize and run cuBLAS.
# Measured on an H200 (docs/gpu_check.md, 2026-12-04 runs 3-4), one Llama-3-8B layer's linears:
# tinygemm 0.10 / 0.18 / 0.28 / 0.52 ms at 1 / 8 / 16 / 32 rows against 0.35 / 0.37 / 0.38 /
# 0.43 ms dequantized + cuBLAS; 8B-shape decode at batch 32 made 2,380 tok/s with 16 here and
# 1,613 with 32.
MAX_ROWS = 16
GROUP_SIZES = (32, 64, 128, 256)
# The tensor-core tile torch's layout is cut into: 8 outputs x 16 inputs.
_TILE_N, _TILE_K = 8, 16


def inner_k_tiles(in_features: int) -> int | None:
    """The most k-tiles (8, 4 or 2, each 16 inputs) an int32 row of the layout may pack for
    this input size: wider ones give the kernel longer loads. None when none divides it."""
    for tiles in (8, 4, 2):
        if in_features % (_TILE_K * tiles) == 0:
            return tiles
    return None


def fits(out_features: int, in_features: int, group: int, dtype: torch.dtype) -> bool:
    """Whether tinygemm takes a layer of this shape, group size and activation dtype."""
    return (dtype == torch.bfloat16 and group in GROUP_SIZES and out_features % _TILE_N == 0
            and inner_k_tiles(in_features) is not None and in_features % group == 0)


def _grid(out_features: int, in_features: int, tiles: int) -> tuple[int, ...]:
    """codes [out, in] viewed as [nt, t // 4, ko, s, a, b, t % 4, hl] (module docstring)."""
    return (out_features // _TILE_N, _TILE_N, in_features // (_TILE_K * tiles), tiles // 2,
            2, 2, 4, 2)


# From codes' [nt, t // 4, ko, s, a, b, t % 4, hl] to the layout's [nt, ko, t // 4, t % 4, s,
# hl, a, b] (the last three: nibble j = 4 hl + 2 a + b), and back.
_TO_LAYOUT = (0, 2, 1, 6, 3, 7, 4, 5)
_FROM_LAYOUT = (0, 2, 1, 4, 6, 7, 3, 5)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [out, in] (values 0..15, any integer dtype) -> tinygemm's int32 layout."""
    out_features, in_features = codes.shape
    tiles = inner_k_tiles(in_features)
    if tiles is None or out_features % _TILE_N:
        raise ValueError(f"tinygemm does not take a {out_features} x {in_features} weight")
    grid = _grid(out_features, in_features, tiles)
    # one byte a code while they move (a layer quantized on the GPU at load: an 8B model's
    # gate/up codes are 117 M), 64-bit words only for the result's eighth
    nibbles = codes.to(torch.uint8).reshape(grid).permute(_TO_LAYOUT)
    nibbles = nibbles.reshape(grid[0], grid[2], 32, tiles // 2, 8)
    words = nibbles[..., 0].to(torch.int64)
    for j in range(1, 8):
        words |= nibbles[..., j].to(torch.int64) << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """tinygemm's int32 layout -> the int4 codes [out, in] as int32."""
    n_tiles, k_outer, lanes, half = packed.shape
    if lanes != 32:
        raise ValueError(f"not a tinygemm layout: {tuple(packed.shape)}")
    tiles = 2 * half
    out_features, in_features = n_tiles * _TILE_N, k_outer * _TILE_K * tiles
    shifts = 4 * torch.arange(8, device=packed.device, dtype=torch.int64)
    nibbles = ((packed.to(torch.int64) & 0xFFFFFFFF)[..., None] >> shifts) & 15
    layout_grid = (n_tiles, k_outer, _TILE_N, 4, half, 2, 2, 2)
    codes = nibbles.reshape(layout_grid).permute(_FROM_LAYOUT)
    return codes.reshape(out_features, in_features).to(torch.int32)


def matmul(x: torch.Tensor, packed: torch.Tensor, group: int,
           scale_zeros: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (bfloat16, contiguous) @ W^T through tinygemm."""
    return torch.ops.aten._weight_int4pack_mm(x, packed, group, scale_zeros)


_AVAILABLE: dict[str, str | None] = {}


def unavailable_reason(device: torch.device) -> str | None:
    """None when tinygemm runs right on `device` (a CUDA GPU), else why not: torch's packing
    of random codes must equal `pack`'s, and the product must match the dequantized weight's
    within bfloat16 rounding. Checked once per device."""
    key = str(device)
    if key not in _AVAILABLE:
        _AVAILABLE[key] = _check(device)
        if _AVAILABLE[key] is not None:
            logger.info("int4 on %s: torch's tinygemm kernel is not used (%s); the Triton "
                        "kernel runs every int4 layer", device, _AVAILABLE[key])
    return _AVAILABLE[key]


def _check(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    gen = torch.Generator().manual_seed(0)
    out_features, in_features, group = 64, 256, 32
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen)
    scales = torch.rand(in_features // group, out_features, generator=gen) * 0.02 + 0.01
    zeros = torch.randn(in_features // group, out_features, generator=gen) * 0.02
    scale_zeros = torch.stack((scales, zeros), dim=-1).to(device, torch.bfloat16)
    x = torch.randn(5, in_features, generator=gen).to(device, torch.bfloat16)
    mine = pack(codes).to(device)
    try:
        nibbles = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
        theirs = torch.ops.aten._convert_weight_to_int4pack(nibbles, inner_k_tiles(in_features))
        if theirs.shape != mine.shape or not torch.equal(theirs, mine):
            return "torch's packing differs from kvserve's reading of it"
        got = matmul(x, mine, group, scale_zeros).float()
    except Exception as exc:  # an op missing from this build, or a GPU older than sm_80
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    sz = scale_zeros.float()
    weight = ((codes.to(device).float().reshape(out_features, -1, group) - 8.0)
              * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None])
    want = x.float() @ weight.reshape(out_features, in_features).t()
    error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
    return None if error <= 2e-2 else f"result off by {error:.2e} of its largest value"
