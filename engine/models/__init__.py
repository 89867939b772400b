"""Model implementations, chosen by the checkpoint's architecture name."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.models.llama import LlamaForCausalLM
from kernels.metadata import AttentionBackend

if TYPE_CHECKING:
    from engine.distributed.parallel_state import ParallelGroups


def build_model(cfg: ModelConfig, backend: AttentionBackend, max_model_len: int,
                device: torch.device, groups: ParallelGroups | None = None
                ) -> LlamaForCausalLM:
    """Llama, Mistral and Qwen2 share one implementation; they differ only in config. With
    tensor-parallel `groups` of more than one rank, this rank's shard of it."""
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {cfg.architecture}")
    if groups is not None and groups.size > 1:
        from engine.models.parallel_layers import TensorParallelLlama

        return TensorParallelLlama(cfg, backend, max_model_len, device, groups)
    return LlamaForCausalLM(cfg, backend, max_model_len, device)
