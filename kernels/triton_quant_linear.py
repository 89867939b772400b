"""Weight-only quantized linears as Triton kernels: the CUDA path of `--quantization int8`,
`int4`, AWQ/GPTQ and a GGUF file's 4-bit blocks (engine/quantization/methods.py).

One kernel reads the codes where they lie and multiplies them into the activations, never
writing a float copy of the weight:

- int8 (`bits=8`): codes int8 [out, in], one scale per output channel, y = (x q^T) * scale;
- int4 (`bits=4`): two codes a byte, input-major [in/2, out] (byte [j, n] holds output n's
  inputs 2j in its low nibble and 2j+1 in its high one, so a step over the inputs reads whole
  rows of bytes across a tile's columns), and per group of `group` inputs a scale and zero
  [groups, out, 2] (torch's tinygemm convention: w = (q - 8) * scale + zero). A step covers at
  most one group.

Each program owns a [BLOCK_M x BLOCK_N] tile of the output and one of `split` slices of the
input dimension (`pick_config`). A weight tile is rebuilt in float32 and rounded to the activations' dtype
before `tl.dot` (the same rounding as the dequantized reference, `LinearMethod.dequantize`);
products accumulate in float32. With a split the slices write float32 partials that a sum joins.
Decode rows are few, so a split gives a GPU's 132 multiprocessors work on every layer shape.

Where Triton runs in its CPU interpreter (TRITON_INTERPRET=1 before triton is imported) the
same code runs on CPU tensors: that is how the tests check it without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

# Programs a launch aims for, by code width: int8's first sweep settled at twice an H200's 132
# multiprocessors; int4's runs best split as far as MAX_SPLIT allows (docs/gpu_check.md: on an
# H200, the 8B shapes' gate/up projection at one row took 0.072 ms split 16 ways against 0.103
# at 448 programs, its down projection 0.054 at 512 programs).
TARGET_PROGRAMS = {8: 264, 4: 4096}
MAX_SPLIT = 16
DEQUANT_BLOCK_N = 128  # outputs a program of the int4 dequantizing kernel


@dataclass(frozen=True)
class TileConfig:
    """One launch's tiling: output tile, input step, input slices, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _quant_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, stride_xm, stride_w, stride_sg,
                         stride_sn, stride_ys, stride_ym, GROUP: tl.constexpr,
                         BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, K_SLICE: tl.constexpr, IEEE: tl.constexpr):
    """y[slice] = x[:, slice] W[:, slice]^T for one [BLOCK_M x BLOCK_N] output tile."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = pid_s * K_SLICE
    for k0 in range(start, start + K_SLICE, BLOCK_K):
        if BITS == 4:
            # A step of BLOCK_K inputs is BLOCK_K / 2 rows of bytes, each BLOCK_N columns wide
            # (contiguous: the codes are input-major); its low nibbles hold the even inputs,
            # its high ones the odd inputs, multiplied by the even and odd activations.
            pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + pairs[:, None].to(tl.int64) * stride_w + cols[None, :],
                             mask=col_ok[None, :], other=0).to(tl.int32)
            at = s_ptr + (k0 // GROUP) * stride_sg + cols * stride_sn  # a step is one group
            scale = tl.load(at, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            zero = tl.load(at + 1, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            low = ((packed & 15).to(tl.float32) - 8.0) * scale + zero
            high = ((packed >> 4).to(tl.float32) - 8.0) * scale + zero
            x_even = tl.load(x_rows + 2 * pairs[None, :], mask=row_ok[:, None], other=0.0)
            x_odd = tl.load(x_rows + 2 * pairs[None, :] + 1, mask=row_ok[:, None], other=0.0)
            if IEEE:
                acc += tl.dot(x_even, low.to(x_even.dtype), input_precision="ieee")
                acc += tl.dot(x_odd, high.to(x_odd.dtype), input_precision="ieee")
            else:
                acc += tl.dot(x_even, low.to(x_even.dtype))
                acc += tl.dot(x_odd, high.to(x_odd.dtype))
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None],
                        mask=col_ok[None, :], other=0).to(tl.float32)
            if IEEE:
                acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
    if BITS == 8:
        acc *= tl.load(s_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + pid_s * stride_ys + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _dequant_int4_kernel(w_ptr, s_ptr, out_ptr, N, stride_w, stride_sg, stride_sn,
                         GROUP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Input-major int4 codes [in/2, out] -> the weight's transpose [in, out] in out's dtype:
    BLOCK_P rows of bytes (2 * BLOCK_P inputs) x BLOCK_N outputs a program."""
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols[None, :] < N
    packed = tl.load(w_ptr + pairs[:, None].to(tl.int64) * stride_w + cols[None, :], mask=ok,
                     other=0).to(tl.int32)
    at = s_ptr + ((2 * pairs[:, None]) // GROUP) * stride_sg + cols[None, :] * stride_sn
    scale = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    zero = tl.load(at + 1, mask=ok, other=0.0).to(tl.float32)
    low = ((packed & 15).to(tl.float32) - 8.0) * scale + zero
    high = ((packed >> 4).to(tl.float32) - 8.0) * scale + zero
    out = out_ptr + (2 * pairs[:, None]).to(tl.int64) * N + cols[None, :]
    tl.store(out, low.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + N, high.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_int4(qweight: torch.Tensor, scale_zeros: torch.Tensor, group: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The float weight of input-major int4 codes, as its transpose [in, out] in `dtype`
    (`weight = result.t()`, a view a matmul takes as it is): one pass that reads the codes and
    writes the floats, for layers past the fused kernel's row limit (prefill chunks), where
    building it from torch ops took ~4.9 ms for an 8B layer's linears on an H200."""
    pairs, out_features = qweight.shape
    if not qweight.is_contiguous() or (2 * pairs) % group:
        raise ValueError(f"int4 codes {tuple(qweight.shape)} do not make groups of {group}")
    out = torch.empty(2 * pairs, out_features, dtype=dtype, device=qweight.device)
    block_p = min(group // 2, 32)
    grid = (triton.cdiv(pairs, block_p), triton.cdiv(out_features, DEQUANT_BLOCK_N))
    _dequant_int4_kernel[grid](qweight, scale_zeros, out, out_features, qweight.stride(0),
                               scale_zeros.stride(0), scale_zeros.stride(1), GROUP=group,
                               BLOCK_P=block_p, BLOCK_N=DEQUANT_BLOCK_N, num_warps=4)
    return out


@triton.jit
def _dequant_tinygemm_kernel(w_ptr, s_ptr, out_ptr, N, K_OUTER, stride_sg, stride_sn,
                             GROUP: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr):
    """tinygemm's int32 layout [out/8, in/(16 TILES), 32, TILES/2] -> the weight's transpose
    [in, out]: BLOCK_N outputs x one ko (16 TILES inputs) a program. The tile's columns are its
    outputs, so a warp's stores of one input run along a row of the result (coalesced: the
    stores are four times the loads' bytes); its rows are an int32's lane t % 4 and slot s
    (engine/quantization/tinygemm.py gives the nibbles' inputs)."""
    ko = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, 2 * TILES)  # t % 4 x slots
    t_lo, s = c // (TILES // 2), c % (TILES // 2)
    ok = n[None, :] < N
    t = 4 * (n[None, :] % 8) + t_lo[:, None]
    word = ((n[None, :] // 8).to(tl.int64) * K_OUTER + ko) * (16 * TILES) + t * (TILES // 2) \
        + s[:, None]
    packed = tl.load(w_ptr + word, mask=ok, other=0)
    for j in tl.static_range(8):
        k = ko * 16 * TILES + 32 * s[:, None] + 16 * ((j // 2) % 2) + 8 * (j % 2) \
            + 2 * t_lo[:, None] + j // 4
        at = s_ptr + (k // GROUP) * stride_sg + n[None, :] * stride_sn
        scale = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        zero = tl.load(at + 1, mask=ok, other=0.0).to(tl.float32)
        w = (((packed >> (4 * j)) & 15).to(tl.float32) - 8.0) * scale + zero
        tl.store(out_ptr + k.to(tl.int64) * N + n[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=ok)


def dequantize_tinygemm(qweight: torch.Tensor, scale_zeros: torch.Tensor, group: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """The float weight of codes in tinygemm's layout, as its transpose [in, out] in `dtype`,
    in one pass (`dequantize_int4`'s counterpart for layers past tinygemm's row limit)."""
    n_tiles, k_outer, lanes, half = qweight.shape
    tiles = 2 * half
    out_features, in_features = 8 * n_tiles, 16 * tiles * k_outer
    if lanes != 32 or not qweight.is_contiguous() or in_features % group:
        raise ValueError(f"{tuple(qweight.shape)} is not tinygemm's layout in groups of {group}")
    out = torch.empty(in_features, out_features, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(out_features, DEQUANT_BLOCK_N), k_outer)
    _dequant_tinygemm_kernel[grid](qweight, scale_zeros, out, out_features, k_outer,
                                   scale_zeros.stride(0), scale_zeros.stride(1), GROUP=group,
                                   TILES=tiles, BLOCK_N=DEQUANT_BLOCK_N, num_warps=4)
    return out


def pick_config(rows: int, out_features: int, in_features: int, group: int,
                block_n: int | None = None, block_k: int | None = None) -> TileConfig:
    """The tiling for a [rows x in] @ [in x out] product (int4 where `group` > 0, else int8):
    few rows (decode) split the inputs until the launch has TARGET_PROGRAMS programs; int8
    past 64 rows takes a wide tile and no split. An int4 step is 32 inputs (at most one group,
    and at least 16 inputs a `tl.dot`), its tile 128 columns up to 16 rows and 256 above (the
    H200 sweep's best at 1 and 64 rows). `block_n` and `block_k` override the choice (the GPU
    check's sweep); the split follows."""
    step = block_k or (min(group, 32) if group else 128)
    while in_features % step:
        step //= 2
    if rows > 64 and not group and block_n is None:
        return TileConfig(64, 128, min(step, 64), 1, 4, 3)
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = block_n or (64 if not group else 128 if rows <= 16 else 256)
    tiles = triton.cdiv(out_features, block_n) * triton.cdiv(rows, block_m)
    steps = in_features // step
    # Past 64 rows (prefill chunks up to TRITON_MAX_FUSED_ROWS; not swept yet) int4 aims at
    # int8's count: its float32 partials grow with the rows.
    target = TARGET_PROGRAMS[4 if group and rows <= 64 else 8]
    split = 1
    while (tiles * split < target and split * 2 <= MAX_SPLIT
           and steps % (split * 2) == 0):
        split *= 2
    return TileConfig(block_m, block_n, step, split, 4, 4)


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int,
                 group: int = 0, config: TileConfig | None = None) -> torch.Tensor:
    """x [rows, in] @ W^T for W in `bits` codes (module docstring); returns x's dtype.

    `qweight`: int8 [out, in], or int4 pairs input-major [in/2, out]; `scales`: [out] for int8,
    [groups, out, 2] scale and zero for int4 (`group` inputs each). `config` overrides
    `pick_config` (the GPU check's sweep)."""
    if x.dim() != 2 or not x.is_contiguous() or not qweight.is_contiguous():
        raise ValueError("quant_linear takes contiguous [rows, in] activations and codes")
    rows, in_features = x.shape
    if bits == 4:
        out_features = qweight.shape[1]
        if qweight.shape[0] * 2 != in_features or in_features % group:
            raise ValueError(f"int4 codes {tuple(qweight.shape)} do not match {in_features} "
                             f"inputs in groups of {group}")
        stride_sg, stride_sn = scales.stride(0), scales.stride(1)
    elif bits == 8:
        out_features = qweight.shape[0]
        if qweight.shape[1] != in_features:
            raise ValueError(f"int8 codes {tuple(qweight.shape)} do not match {in_features} "
                             "inputs")
        stride_sg, stride_sn = 0, scales.stride(0)
    else:
        raise ValueError(f"quant_linear takes 4- or 8-bit codes, not {bits}")
    cfg = config or pick_config(rows, out_features, in_features, group if bits == 4 else 0)
    if config is None and x.dtype == torch.float32:
        # float32 tiles take twice the shared memory a stage: int8's 64-row tile (64 x 64, 128
        # inputs a step) in 4 stages needs 128 KiB, past an sm_89 GPU's 99 KiB (found by
        # tests/kernels/test_triton_targets.py)
        cfg = replace(cfg, num_stages=min(cfg.num_stages, 2))
    k_slice = in_features // cfg.split
    if (in_features % cfg.split or k_slice % cfg.block_k
            or (bits == 4 and group % cfg.block_k)):
        raise ValueError(f"{cfg} does not tile {in_features} inputs"
                         + (f" in groups of {group}" if bits == 4 else ""))
    if cfg.split == 1:
        y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(cfg.split, rows, out_features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(out_features, cfg.block_n), triton.cdiv(rows, cfg.block_m), cfg.split)
    _quant_linear_kernel[grid](
        x, qweight, scales, y, rows, out_features, x.stride(0), qweight.stride(0), stride_sg,
        stride_sn, y.stride(0) if cfg.split > 1 else 0, y.stride(-2), GROUP=group or 1,
        BITS=bits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        K_SLICE=k_slice, IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y if cfg.split == 1 else y.sum(0).to(x.dtype)
