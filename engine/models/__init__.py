"""Model implementations, chosen by the checkpoint's architecture name."""

from __future__ import annotations

import torch

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.models.llama import LlamaForCausalLM
from kernels.metadata import AttentionBackend


def build_model(cfg: ModelConfig, backend: AttentionBackend, max_model_len: int,
                device: torch.device) -> LlamaForCausalLM:
    """Llama, Mistral and Qwen2 share one implementation; they differ only in config."""
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {cfg.architecture}")
    return LlamaForCausalLM(cfg, backend, max_model_len, device)
