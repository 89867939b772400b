"""int4 layers on torch's tinygemm kernel (engine/quantization/tinygemm.py): kvserve's reading
of tinygemm's int32 layout against a literal transcription of torch's packing loop, the Triton
kernel that dequantizes that layout (interpreter here, compiled on a GPU), and the layers: past
the row limit here, every row count on a GPU, where torch's own packing and kernel run."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import engine.quantization as quant  # noqa: E402
from engine.quantization import (  # noqa: E402
    ApplyPlan,
    Int4Method,
    QuantizedLinear,
    probe_fused,
    tinygemm,
)
from tests.support.triton_interpreter import import_kernels  # noqa: E402

tq = import_kernels("kernels.triton_quant_linear")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda" and tinygemm.unavailable_reason(DEVICE) is None
# (outputs, inputs): inner k-tiles 2 (inputs 32), 4 (64, 192) and 8 (128, 384)
SHAPES = [(8, 32), (16, 64), (24, 192), (8, 128), (16, 384)]


def literal_pack(codes: torch.Tensor) -> torch.Tensor:
    """torch's CUDA packing kernel (`matrix_to_m16n8k16_Bint4_layout`, NVIDIA branch) written out
    loop by loop: its input is [n][k/2] bytes with input 2i in the high nibble and 2i + 1 in the
    low one (gpt-fast's and torchao's packing), each lane t of a tile gathers four bytes and
    spreads their nibbles over one int32."""
    n, k = codes.shape
    tiles = tinygemm.inner_k_tiles(k)
    assert tiles is not None
    c = codes.tolist()
    byte = [[(c[r][2 * i] << 4) | c[r][2 * i + 1] for i in range(k // 2)] for r in range(n)]
    out = torch.zeros(n // 8, k // (16 * tiles), 32, tiles // 2, dtype=torch.int64)
    for n_tile in range(n // 8):
        for k_outer in range(k // (16 * tiles)):
            for t in range(32):
                for inner in range(0, tiles, 2):
                    n0 = n_tile * 8 + t // 4
                    base0 = (k_outer * tiles + inner) * 16 // 2
                    base1 = base0 + 16 // 2
                    ks = [base0 + t % 4, base0 + t % 4 + 4, base1 + t % 4, base1 + t % 4 + 4]
                    v = [byte[n0][i] for i in ks]
                    word = (((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20)
                            | ((v[0] & 0xF) << 16) | ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4)
                            | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4))
                    out[n_tile, k_outer, t, inner // 2] = word - (1 << 32 if word >> 31 else 0)
    return out.to(torch.int32)


def _codes(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (out_features, in_features), generator=gen)


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_is_torchs_layout_and_unpack_inverts_it(shape: tuple[int, int]) -> None:
    codes = _codes(*shape)
    packed = tinygemm.pack(codes)
    assert packed.dtype == torch.int32 and torch.equal(packed, literal_pack(codes))
    assert torch.equal(tinygemm.unpack(packed), codes.to(torch.int32))


def test_fits_takes_bfloat16_and_the_kernels_groups_and_shapes() -> None:
    assert tinygemm.fits(4096, 4096, 32, torch.bfloat16)
    assert tinygemm.fits(576, 1536, 128, torch.bfloat16)
    assert not tinygemm.fits(4096, 4096, 32, torch.float16)  # tinygemm is bf16 only
    assert not tinygemm.fits(4096, 4096, 16, torch.bfloat16)
    assert not tinygemm.fits(4100, 4096, 32, torch.bfloat16)  # outputs in tiles of 8
    assert not tinygemm.fits(64, 48, 32, torch.bfloat16)  # inputs in k-tiles of 16, 2 or more
    with pytest.raises(ValueError, match="tinygemm does not take"):
        tinygemm.pack(_codes(12, 64))
    if DEVICE.type != "cuda":
        assert tinygemm.unavailable_reason(DEVICE) == "not a CUDA device"


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizing_kernel_rebuilds_the_weight(group: int, dtype: torch.dtype) -> None:
    out_features, in_features = 136, 384  # 17 tiles of 8 outputs: a part-filled program
    codes = _codes(out_features, in_features, 1)
    gen = torch.Generator().manual_seed(2)
    scale_zeros = (torch.rand(in_features // group, out_features, 2, generator=gen) * 0.1
                   - 0.02).to(dtype)
    plan = ApplyPlan("dequant", dtype)
    tensors = {"qweight": tinygemm.pack(codes).to(DEVICE), "scale_zeros": scale_zeros.to(DEVICE),
               "layout_tinygemm": torch.empty(0, dtype=torch.uint8)}
    want = Int4Method(plan, group).dequantize({k: v.cpu() for k, v in tensors.items()})
    got = tq.dequantize_tinygemm(tensors["qweight"], tensors["scale_zeros"], group, dtype)
    assert got.shape == (in_features, out_features) and got.dtype == dtype
    # the same float32 arithmetic; its rounding to bfloat16 may differ by one unit (Triton's
    # interpreter, a fused multiply-add on a GPU)
    torch.testing.assert_close(got.t().cpu(), want, rtol=2**-7 if dtype == torch.bfloat16
                               else 1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="not tinygemm's layout"):
        tq.dequantize_tinygemm(tensors["qweight"], tensors["scale_zeros"], 256, dtype)


TINYGEMM = ApplyPlan("fused", torch.bfloat16, "triton", tinygemm=True)


@pytest.mark.parametrize("rows", [1, 16, 17, 40] if ON_GPU else [17, 40])
def test_layer_on_the_tinygemm_plan(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to tinygemm.MAX_ROWS rows through tinygemm (on a GPU), past it through the
    dequantizing kernel and one matmul; both against the dequantized weight."""
    method = Int4Method(TINYGEMM, 32)
    linear = torch.nn.Linear(256, 48, bias=True)
    layer = QuantizedLinear(linear, method, device=DEVICE)
    tensors = layer.tensors()
    assert layer.fused and "layout_tinygemm" in tensors
    assert tensors["qweight"].shape == (6, 2, 32, 4)  # 48 / 8 tiles, 256 inputs / 128
    assert tensors["scale_zeros"].dtype == torch.bfloat16
    nibbles = Int4Method(ApplyPlan("dequant", torch.float32), 32)
    assert torch.equal(method.unpack_codes(tensors).cpu(), nibbles.unpack_codes(
        nibbles.create_weights(linear.weight.detach())))
    calls: list[str] = []
    dequant = tq.dequantize_tinygemm
    monkeypatch.setattr(tq, "dequantize_tinygemm",
                        lambda *a: calls.append("dequant") or dequant(*a))
    kernel = tinygemm.matmul
    monkeypatch.setattr(tinygemm, "matmul", lambda *a: calls.append("tinygemm") or kernel(*a))
    x = torch.randn(rows, 256, device=DEVICE)
    want = (x.bfloat16().float() @ layer.dequantized_weight().float().t()
            + linear.bias.detach().to(DEVICE).bfloat16().float())
    got = layer(x)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert calls == ["tinygemm" if rows <= tinygemm.MAX_ROWS else "dequant"]


@pytest.mark.skipif(not ON_GPU, reason="tinygemm runs on CUDA GPUs (sm_80 and later) only")
def test_the_cuda_plan_takes_tinygemm_for_bfloat16_int4() -> None:
    plan = quant.apply_plan("int4", torch.bfloat16, DEVICE)
    assert plan.tinygemm and plan.kernel == "triton"
    assert not quant.apply_plan("int4", torch.float16, DEVICE).tinygemm
    assert not quant.apply_plan("int8", torch.bfloat16, DEVICE).tinygemm
    assert probe_fused(Int4Method(plan, 32)) is None
