"""kvserve's quantized linears (kernels/cpu/quant/qgemm.cpp) and their tiled layouts
(engine/quantization/tiles.py): each path against an independent torch computation.

- path 1 (float): the dequantized weight's float matmul, to float rounding;
- path 2 (int8 dot): the same arithmetic written in torch (x quantized to int8 per block of 32,
  integer block sums, float scales), to float rounding; and the dequantized weight's matmul
  within the error int8 activations cost.
"""

from __future__ import annotations

import pytest
import torch

from engine.quantization import tiles
from tests.support.cpu_ops import require_cpu_ops

FLOAT, INT8_DOT = 1, 2


@pytest.fixture(scope="module")
def ops() -> object:
    return require_cpu_ops()


def _paths(ops: object) -> list[int]:
    return [FLOAT, INT8_DOT]


def _int4(n: int, k: int, group: int, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    mins = -torch.rand(n, k // group, generator=gen) * 0.1
    return codes, scales, mins


def _quantized_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the kernel quantizes it: codes [M, K] and block scales [M, K / 32]."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = (blocks * inv).round().clamp(-128, 127)
    return codes.reshape(x.shape), (amax / 127.0).squeeze(-1)


def _int4_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor) -> torch.Tensor:
    """The int8-dot path's arithmetic in float64."""
    qx, dx = _quantized_x(x)
    m, k = x.shape
    n, groups = scales.shape
    per_block = torch.einsum("mbi,nbi->mnb", qx.double().reshape(m, -1, 32),
                             codes.double().reshape(n, -1, 32))  # exact integer sums
    block_scale = scales.double().repeat_interleave(k // groups // 32, dim=1)  # [n, blocks]
    y = (per_block * dx.double()[:, None, :] * block_scale[None]).sum(-1)
    # the mins meet the quantized x's sums: the result is w . x' exactly
    x_sums = (qx.double().reshape(m, -1, 32).sum(-1) * dx.double()).reshape(m, groups, -1).sum(-1)
    return y + x_sums @ mins.double().t()


@pytest.mark.parametrize("n, k, group", [(16, 32, 32), (48, 96, 32), (32, 256, 64),
                                         (64, 512, 128), (96, 576, 32)])
def test_int4_tiles_pack_and_unpack(n: int, k: int, group: int) -> None:
    codes, scales, mins = _int4(n, k, group)
    qweight, scale_mins = tiles.pack_int4(codes, scales, mins, torch.float32)
    assert qweight.shape == (n // 16, k // 32 * 256) and qweight.dtype == torch.uint8
    assert scale_mins.shape == (n // 16, k // group, 2, 16)
    back, s, m = tiles.unpack_int4(qweight, scale_mins)
    assert torch.equal(back, codes) and torch.equal(s, scales) and torch.equal(m, mins)


def test_int8_tiles_pack_unpack() -> None:
    codes = torch.randint(-127, 128, (48, 96), dtype=torch.int8)
    packed = tiles.pack_int8(codes)
    assert packed.shape == (3, 3 * 512)
    assert torch.equal(tiles.unpack_int8(packed), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_embedding_reads_rows_of_the_tiles_times_their_scales(ops: object,
                                                                 dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (48, 96), dtype=torch.int8, generator=gen)
    scales = (torch.rand(48, generator=gen) / 100).to(dtype)
    rows = torch.tensor([0, 17, 47, 5, 17])
    got = ops.q8_embedding(rows, tiles.pack_int8(codes), scales, dtype)  # type: ignore[attr-defined]
    want = (codes[rows].float() * scales[rows].float()[:, None]).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.q8_embedding(torch.tensor([48]), tiles.pack_int8(codes), scales,  # type: ignore[attr-defined]
                         dtype)


def test_shapes_that_do_not_tile_are_refused() -> None:
    assert not tiles.tiles_fit(40, 64) and not tiles.tiles_fit(48, 48)
    with pytest.raises(ValueError, match="out % 16"):
        tiles.pack_int8(torch.zeros(40, 64, dtype=torch.int8))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 17, 1003])  # 1003: several L2 chunks
@pytest.mark.parametrize("n, k, group", [(48, 96, 32), (32, 256, 64), (64, 512, 128),
                                         (96, 576, 32)])
def test_q4_linear_paths(ops: object, rows: int, n: int, k: int, group: int) -> None:
    codes, scales, mins = _int4(n, k, group, seed=rows)
    qweight, scale_mins = tiles.pack_int4(codes, scales, mins, torch.float32)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    w = codes.double().reshape(n, -1, group) * scales.double()[..., None] + mins.double()[..., None]
    dense = x.double() @ w.reshape(n, k).t()
    for path in _paths(ops):
        got = ops.q4_linear(x, qweight, scale_mins, path).double()  # type: ignore[attr-defined]
        if path == FLOAT:
            torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got, _int4_reference(x, codes, scales, mins),
                                       rtol=1e-5, atol=1e-4)
            assert (got - dense).abs().max() <= 1.5e-2 * dense.abs().max()


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k, group", [(48, 96, 32), (64, 512, 128), (96, 576, 32)])
def test_q4_one_row_equals_its_row_in_a_batch(ops: object, scale_dtype: torch.dtype, n: int,
                                              k: int, group: int) -> None:
    """A single row (batch-1 decode: its own tile routine, high nibbles masked in place and
    the sums scaled by 16) gives, bit for bit, what the same row gives inside a batch."""
    codes, scales, mins = _int4(n, k, group, seed=3)
    qweight, scale_mins = tiles.pack_int4(codes, scales, mins, scale_dtype)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, k, generator=torch.Generator().manual_seed(11)) * 3).to(dtype)
        batch = ops.q4_linear(x, qweight, scale_mins, INT8_DOT)  # type: ignore[attr-defined]
        for i in range(5):
            one = ops.q4_linear(x[i:i + 1], qweight, scale_mins, INT8_DOT)  # type: ignore[attr-defined]
            assert torch.equal(one[0], batch[i]), (dtype, i)


@pytest.mark.parametrize("n", [48, 80])  # 3 and 5 tiles: pairs and a single in one thread
def test_q4_output_does_not_depend_on_the_thread_count(ops: object, n: int) -> None:
    """Tiles run in pairs where a thread holds two (an odd one alone): how the threads split
    the tiles changes which, never a bit of the output."""
    codes, scales, mins = _int4(n, 96, 32, seed=5)
    qweight, scale_mins = tiles.pack_int4(codes, scales, mins, torch.float16)
    x = torch.randn(13, 96, generator=torch.Generator().manual_seed(2)) * 2
    threads = torch.get_num_threads()
    try:
        outs = []
        for num in (1, 2, 3, 5):
            torch.set_num_threads(num)
            outs.append(ops.q4_linear(x, qweight, scale_mins, INT8_DOT))  # type: ignore[attr-defined]
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


# 13 and 1003 end in a group of 5 and 3 rows (passes of 8); 1003 spans several L2 chunks
@pytest.mark.parametrize("rows", [1, 4, 9, 13, 16, 1003])
def test_q8_linear_paths(ops: object, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    codes = torch.randint(-127, 128, (80, 192), generator=gen, dtype=torch.int8)
    scales = torch.rand(80, generator=gen) * 0.01
    x = torch.randn(rows, 192, generator=gen)
    dense = x.double() @ (codes.double() * scales.double()[:, None]).t()
    qx, dx = _quantized_x(x)
    per_block = torch.einsum("mbi,nbi->mnb", qx.double().reshape(rows, -1, 32),
                             codes.double().reshape(80, -1, 32))
    exact = (per_block * dx.double()[:, None, :]).sum(-1) * scales.double()
    for path in _paths(ops):
        got = ops.q8_linear(x, tiles.pack_int8(codes), scales, path).double()  # type: ignore[attr-defined]
        if path == FLOAT:
            torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_and_scales(ops: object, dtype: torch.dtype) -> None:
    """x, scales and the output in a 16-bit type: the float32 computation rounded once."""
    codes, scales, mins = _int4(32, 128, 32)
    qweight, scale_mins = tiles.pack_int4(codes, scales, mins, dtype)
    wide = tiles.pack_int4(codes, *tiles.unpack_int4(qweight, scale_mins)[1:], torch.float32)[1]
    x = torch.randn(3, 128).to(dtype)
    for path in _paths(ops):
        got = ops.q4_linear(x, qweight, scale_mins, path)  # type: ignore[attr-defined]
        want = ops.q4_linear(x.float(), qweight, wide, path).to(dtype)  # type: ignore[attr-defined]
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_zero_rows_and_bad_shapes(ops: object) -> None:
    codes, scales, mins = _int4(16, 64, 32)
    qweight, scale_mins = tiles.pack_int4(codes, scales, mins, torch.bfloat16)
    assert ops.q4_linear(torch.zeros(0, 64, dtype=torch.bfloat16), qweight,  # type: ignore[attr-defined]
                         scale_mins).shape == (0, 16)
    with pytest.raises(RuntimeError, match=r"x must be a float tensor \[rows, 64\]"):
        ops.q4_linear(torch.zeros(2, 32), qweight, scale_mins)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="scale_mins must be contiguous"):
        ops.q4_linear(torch.zeros(2, 64), qweight, scale_mins[:, :1].squeeze(1))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="unknown path"):
        ops.q4_linear(torch.zeros(2, 64), qweight, scale_mins, 7)  # type: ignore[attr-defined]


# ---- 5- and 8-bit codes with a scale and min per group (GGUF's Q5 and Q8_0 blocks) ----------

# bits -> (the op, the packer, the unpacker, bytes per tile block)
CODE_BITS = {5: ("u5_linear", tiles.pack_u5, tiles.unpack_u5, 320),
             8: ("u8_linear", tiles.pack_u8, tiles.unpack_u8, 512)}


def _coded(bits: int, n: int, k: int, group: int, seed: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes over all of 0..2^bits - 1 with a min near -2^(bits-1) x scale (Q8_0's, Q5_0's)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=gen) * 0.002 + 0.0001
    mins = -(1 << (bits - 1)) * scales + torch.randn(n, k // group, generator=gen) * 0.01
    return codes, scales, mins


@pytest.mark.parametrize("bits", CODE_BITS)
def test_coded_tiles_pack_and_unpack(bits: int) -> None:
    _, pack, unpack, block_bytes = CODE_BITS[bits]
    codes, scales, mins = _coded(bits, 48, 96, 32)
    qweight, scale_mins = pack(codes, scales, mins, torch.float32)
    assert qweight.shape == (3, 3 * block_bytes) and qweight.dtype == torch.uint8
    assert scale_mins.shape == (3, 3, 2, 16)
    back, s, m = unpack(qweight, scale_mins)
    assert torch.equal(back, codes) and torch.equal(s, scales) and torch.equal(m, mins)
    with pytest.raises(ValueError, match="out % 16"):
        pack(codes[:40], scales[:40], mins[:40], torch.float32)


@pytest.mark.parametrize("bits", CODE_BITS)
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 64, 1003])
@pytest.mark.parametrize("n, k, group", [(48, 96, 32), (64, 512, 64), (96, 576, 32)])
def test_coded_linear_paths(ops: object, bits: int, rows: int, n: int, k: int,
                            group: int) -> None:
    op, pack, _, _ = CODE_BITS[bits]
    codes, scales, mins = _coded(bits, n, k, group, seed=rows)
    qweight, scale_mins = pack(codes, scales, mins, torch.float32)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    w = codes.double().reshape(n, -1, group) * scales.double()[..., None] + mins.double()[..., None]
    dense = x.double() @ w.reshape(n, k).t()
    for path in _paths(ops):
        got = getattr(ops, op)(x, qweight, scale_mins, path).double()
        if path == FLOAT:
            torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got, _int4_reference(x, codes, scales, mins),
                                       rtol=1e-5, atol=1e-4)
            assert (got - dense).abs().max() <= 1.5e-2 * dense.abs().max()


@pytest.mark.parametrize("bits", CODE_BITS)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_coded_one_row_equals_its_row_in_a_batch_at_any_thread_count(
        ops: object, bits: int, scale_dtype: torch.dtype) -> None:
    """One row (its own tile routine) gives, bit for bit, its row in a batch (tiles in pairs),
    however many threads split the tiles."""
    op, pack, _, _ = CODE_BITS[bits]
    kernel = getattr(ops, op)
    codes, scales, mins = _coded(bits, 80, 576, 32, seed=3)
    qweight, scale_mins = pack(codes, scales, mins, scale_dtype)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(11)) * 3
    threads = torch.get_num_threads()
    try:
        batches = []
        for num in (1, 2, 3):
            torch.set_num_threads(num)
            batches.append(kernel(x, qweight, scale_mins, INT8_DOT))
            for i in range(5):
                one = kernel(x[i:i + 1], qweight, scale_mins, INT8_DOT)
                assert torch.equal(one[0], batches[0][i]), (num, i)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(b, batches[0]) for b in batches)
