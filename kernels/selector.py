"""Picks the attention backend for a device: the torch twins on CPU, Triton on CUDA."""

from __future__ import annotations

import torch

from kernels.metadata import AttentionBackend
from kernels.torch_attention import TorchAttentionBackend


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` is Triton on CUDA (torch there too if triton is missing) and torch elsewhere;
    `triton` and `torch` force one. Triton is imported only when chosen, so CPU installs
    without it work."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if name not in ("auto", "triton"):
        raise ValueError(f"unknown attention backend {name!r}; choose auto, triton or torch")
    try:
        from kernels.triton_attention import TritonAttentionBackend
    except ImportError as exc:
        if name == "auto":
            return TorchAttentionBackend()
        raise ValueError(f"attention backend 'triton' needs the triton package: {exc}") from exc
    return TritonAttentionBackend(device)
