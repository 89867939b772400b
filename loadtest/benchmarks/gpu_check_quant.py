"""The GPU check's weight-only quantized linears (kernels/triton_quant_linear.py).

For the Llama-3-8B decoder's linear shapes at decode and prefill row counts: ms per product of
int4 (groups of 32, the default at load) and int8 through the Triton kernel, beside the
bfloat16 matmul (cuBLAS), the torch ops that dequantize the weight before a bfloat16 matmul
(what every layer did on CUDA before the kernel) and the int4 dequantizing kernel before one
(what a layer past the fused kernel's row limit does); where torch's tinygemm kernel passes its
check on the GPU (engine/quantization/tinygemm.py), int4 through it at every row count and
through the dequantizing kernel for its layout; weight bytes read per second at one row
against the copy bandwidth; and a sweep of tiles at 1 and 64 rows. On CPU (the smoke run) the kernel needs Triton's interpreter, which
this process does not run in: the section times the torch paths of tiny shapes only.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.nn import functional as F

from engine.quantization import ApplyPlan, Int4Method, Int8Method, tinygemm
from loadtest.benchmarks.gpu_check_kernels import copy_bandwidth, timed
from loadtest.benchmarks.gpu_check_report import Report, release

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
# 8 and 32 bracket tinygemm's row limit (tinygemm.MAX_ROWS)
ROWS = (1, 8, 16, 32, 64, 256, 1024)
# (block_n, block_k, num_warps, num_stages) tried at 1 and 64 rows; the split follows. A step
# covers at most one group of 32 and feeds `tl.dot` 16 inputs at least: block_k is 32.
SWEEP = ((64, 32, 4, 4), (128, 32, 4, 4), (128, 32, 4, 3), (128, 32, 8, 4), (256, 32, 4, 4),
         (256, 32, 8, 4))
SWEEP_SHAPES = ("gate_up", "down")


def _methods(dtype: torch.dtype, kernel: str, device: torch.device
             ) -> dict[str, Int4Method | Int8Method]:
    plan = ApplyPlan("fused", dtype, kernel)
    methods: dict[str, Int4Method | Int8Method] = {"int4": Int4Method(plan, 32),
                                                   "int8": Int8Method(plan)}
    if kernel == "triton" and dtype == torch.bfloat16 and \
            tinygemm.unavailable_reason(device) is None:
        methods["int4_tinygemm"] = Int4Method(ApplyPlan("fused", dtype, kernel, True), 32)
    return methods


def _int4_bytes(out_features: int, in_features: int) -> int:
    return out_features * in_features // 2 + (in_features // 32) * out_features * 2 * 2


def quant_linears(report: Report, device: torch.device, small: bool) -> None:
    """The rows of the section (module docstring)."""
    on_gpu = device.type == "cuda"
    shapes = {"o": (64, 128)} if small else SHAPES
    rows_list = (1, 20) if small else ROWS
    dtype = torch.bfloat16 if on_gpu else torch.float32
    copy_gbs = copy_bandwidth(device, 2**31 if on_gpu else 2**24)
    methods = _methods(dtype, "triton" if on_gpu else "cpu", device)
    rows_out: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features, generator=gen, device=device) * 0.02
        for rows in rows_list:
            x = torch.randn(rows, in_features, generator=gen, device=device).to(dtype)
            rows_out.append({"shape": name, "rows": rows,
                             **_time_product(x, weight, methods, device, on_gpu)})
            if on_gpu and name in SWEEP_SHAPES and rows in (1, 64):
                sweep += _sweep(name, rows, x, methods["int4"].create_weights(weight), device)
        del weight
        release(device)
    report.sections["quant_linears"] = {"copy_gbs": copy_gbs, "rows": rows_out, "sweep": sweep}
    if not on_gpu:
        report.add("int4/int8 Triton linears", "not timed on CPU (the smoke)")
        return
    one = [r for r in rows_out if r["rows"] == 1]
    total = sum(_int4_bytes(*shapes[r["shape"]]) for r in one)
    int4_ms, bf16_ms = sum(r["int4_ms"] for r in one), sum(r["bf16_ms"] for r in one)
    report.add("int4 linears, 1 row (8B layer)",
               f"{int4_ms:.3f} ms vs bf16 {bf16_ms:.3f} ms ({bf16_ms / int4_ms:.2f}x); "
               f"{total / int4_ms / 1e6:.0f} GB/s = {total / int4_ms / 1e6 / copy_gbs:.0%} of "
               "copy")
    for rows in rows_list[1:]:
        at = [r for r in rows_out if r["rows"] == rows]
        report.add(f"int4 linears, {rows} rows (8B layer)",
                   f"triton {sum(r['int4_ms'] for r in at):.3f} ms, int8 "
                   f"{sum(r['int8_ms'] for r in at):.3f}, bf16 {sum(r['bf16_ms'] for r in at):.3f},"
                   f" dequant+bf16 {sum(r['dequant_int4_ms'] for r in at):.3f}, dequant kernel"
                   f"+bf16 {sum(r['dequant_kernel_int4_ms'] for r in at):.3f}")
    tiny = [r for r in rows_out if "int4_tinygemm_ms" in r]
    if not tiny:
        report.add("int4 on tinygemm", f"not timed: {tinygemm.unavailable_reason(device)}")
    for rows in rows_list if tiny else ():
        at = [r for r in tiny if r["rows"] == rows]
        report.add(f"int4 on tinygemm, {rows} rows (8B layer)",
                   f"tinygemm {sum(r['int4_tinygemm_ms'] for r in at):.3f} ms, its dequant "
                   f"kernel+bf16 {sum(r['dequant_tinygemm_ms'] for r in at):.3f}, triton "
                   f"{sum(r['int4_ms'] for r in at):.3f}, bf16 {sum(r['bf16_ms'] for r in at):.3f}"
                   f" (kvserve runs tinygemm up to {tinygemm.MAX_ROWS} rows)")
    if sweep:
        best: dict[tuple[str, int], dict[str, Any]] = {}
        for entry in sweep:
            if "ms" not in entry:
                continue
            key = (entry["shape"], entry["rows"])
            if key not in best or entry["ms"] < best[key]["ms"]:
                best[key] = entry
        report.add("int4 tile sweep, best", "; ".join(
            f"{s} x {r}: {e['config']} {e['ms']:.3f} ms (picked {e['picked_ms']:.3f})"
            for (s, r), e in best.items()))


def _time_product(x: torch.Tensor, weight: torch.Tensor,
                  methods: dict[str, Int4Method | Int8Method], device: torch.device,
                  on_gpu: bool) -> dict[str, float]:
    """ms of x @ weight^T each way (module docstring)."""
    dense = weight.to(x.dtype)
    tensors = {k: m.create_weights(weight) for k, m in methods.items()}
    int4 = methods["int4"]
    row = {"bf16_ms": timed(lambda: F.linear(x, dense), device),
           "dequant_int4_ms": timed(lambda: F.linear(x, int4.dequantize(tensors["int4"])),
                                    device)}
    if on_gpu:  # the dequantizing kernel (past the fused kernel's row limit), then the fused
        row["dequant_kernel_int4_ms"] = timed(
            lambda: F.linear(x, int4.matmul_weight(tensors["int4"])), device)
        if "int4_tinygemm" in methods:
            tiny = methods["int4_tinygemm"]
            row["dequant_tinygemm_ms"] = timed(
                lambda: F.linear(x, tiny.matmul_weight(tensors["int4_tinygemm"])), device)
        for key, method in methods.items():
            row[f"{key}_ms"] = timed(partial(method.fused_matmul, x, tensors[key]), device)
        row["int4_gbs"] = _int4_bytes(*weight.shape) / row["int4_ms"] / 1e6
    return row


def _sweep(name: str, rows: int, x: torch.Tensor, tensors: dict[str, torch.Tensor],
           device: torch.device) -> list[dict[str, Any]]:
    """Each SWEEP tiling of one int4 product, beside the picked one."""
    from kernels.triton_quant_linear import TileConfig, pick_config, quant_linear

    qweight, scale_zeros = tensors["qweight"], tensors["scale_zeros"]
    in_features, out_features = x.shape[1], qweight.shape[1]  # the codes are input-major
    picked = timed(lambda: quant_linear(x, qweight, scale_zeros, 4, 32), device)
    found = []
    for block_n, block_k, warps, stages in SWEEP:
        base = pick_config(rows, out_features, in_features, 32, block_n, block_k)
        cfg = TileConfig(base.block_m, block_n, base.block_k, base.split, warps, stages)
        try:
            ms = timed(partial(quant_linear, x, qweight, scale_zeros, 4, 32, cfg), device)
        except Exception as exc:  # a tile this GPU rejects: recorded, the sweep goes on
            found.append({"shape": name, "rows": rows, "config": str(cfg), "error": str(exc)[:200]})
            continue
        found.append({"shape": name, "rows": rows, "ms": ms, "picked_ms": picked,
                      "config": f"n{block_n} k{base.block_k} s{base.split} w{warps} st{stages}"})
    return [f for f in found if "ms" in f] + [f for f in found if "error" in f]
