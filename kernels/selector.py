"""Picks the attention backend for a device (the torch twins on CPU, Triton on CUDA) and
refuses, before anything is allocated, a configuration the Triton kernels cannot compile for."""

from __future__ import annotations

import torch

from kernels import cpu_ops
from kernels.cpu_attention import CpuAttentionBackend
from kernels.metadata import AttentionBackend
from kernels.torch_attention import TorchAttentionBackend

# KV block sizes the Triton kernels tile: a block is one side of tl.dot, which needs >= 16.
# The attention kernel tiles key positions independently of the block (each position finds
# its block), so every block size the engine accepts works.
TRITON_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# fp8 e4m3 conversions exist from sm_89 (Ada, Hopper) on; e5m2 compiles from sm_80.
FP8_E4M3_MIN_CAPABILITY = (8, 9)


def check_triton_support(block_size: int, kv_cache_dtype: torch.dtype | None,
                         capability: tuple[int, int] | None) -> None:
    """Raises ValueError naming what works when the Triton kernels cannot serve this block size
    or KV element type on a GPU of this compute capability (None: not a CUDA device)."""
    if block_size not in TRITON_BLOCK_SIZES:
        raise ValueError(
            f"--block-size {block_size} is not served by the triton attention backend: use "
            f"--block-size "
            f"{', '.join(map(str, TRITON_BLOCK_SIZES))}, or --attention-backend torch")
    if (kv_cache_dtype == torch.float8_e4m3fn and capability is not None
            and capability < FP8_E4M3_MIN_CAPABILITY):
        major, minor = capability
        raise ValueError(
            f"--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer (Ada, "
            f"Hopper) for the triton kernels; this one is sm_{major}{minor}: use --kv-cache-dtype "
            "fp8_e5m2 (the same 1 byte per element, coarser mantissa) or auto")


def get_attention_backend(name: str, device: torch.device, block_size: int = 16,
                          kv_cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """`auto` is Triton on CUDA (torch there too if triton is missing) and kvserve's C++ ops on
    CPU (the torch twins where they cannot be built); `cpu`, `triton` and `torch` force one.
    Triton is imported only when chosen, so CPU installs without it work. The Triton choice is
    checked against the block size, the KV element type and the GPU before it is made."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu" or (name == "auto" and device.type != "cuda"):
        return _cpu_backend(name, device)
    if name not in ("auto", "triton"):
        raise ValueError(f"unknown attention backend {name!r}; choose auto, cpu, triton or "
                         "torch")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    check_triton_support(block_size, kv_cache_dtype, capability)
    try:
        from kernels.triton_attention import TritonAttentionBackend
    except ImportError as exc:
        if name == "auto":
            return TorchAttentionBackend()
        raise ValueError(f"attention backend 'triton' needs the triton package: {exc}") from exc
    return TritonAttentionBackend(device)


def _cpu_backend(name: str, device: torch.device) -> AttentionBackend:
    if device.type != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on CPU tensors; this engine is on "
                         f"{device.type}: use auto, triton or torch")
    ops = cpu_ops.load()
    if ops is not None:
        return CpuAttentionBackend(ops)
    if name == "cpu":
        raise ValueError("attention backend 'cpu' needs kvserve's C++ CPU ops, which could not "
                         "be built here (see the WARNING above); use --attention-backend torch")
    return TorchAttentionBackend()
