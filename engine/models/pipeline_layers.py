"""Pipeline-parallel Llama: one stage's contiguous slice of the decoder layers.

The first stage embeds the tokens; every other stage receives the previous stage's hidden
states (the residual stream: each DecoderLayer adds its attention and MLP outputs into it, so
the one tensor carries the residual too) and runs its layers; the last stage applies the final
norm and owns the LM head. A stage builds and loads only its own layers (renumbered from 0), and
the runner allocates KV tensors for those layers only. The links that move hidden states
between stages are implemented in engine/distributed/stage_link.py; here only their shape, so
the model does not import the process layer.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.distributed.parallel_state import ParallelGroups, rank_model_config
from engine.models.llama import LlamaForCausalLM
from engine.models.parallel_layers import (
    StepSender,
    gather_logits,
    shard_modules,
    shard_weights,
    zero_vocab_padding,
)
from kernels.metadata import AttentionBackend, AttentionMetadata

_LAYER_NAME = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: contiguous, as even as possible, the earlier stages
    taking the remainder (the last stage also runs the LM head and the sampler's rank)."""
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def check_pipeline_parallel_size(cfg: ModelConfig, size: int) -> None:
    """Raises ValueError when there are more stages than layers (each stage needs one)."""
    if size > cfg.num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size {size} is larger than this model's "
            f"{cfg.num_hidden_layers} layers: every stage needs at least one layer; use 1 to "
            f"{cfg.num_hidden_layers}")


def stage_kv_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes the largest stage's KV cache holds (its layers only). Every stage allocates
    the same number of blocks, so the largest one sizes the plan. Size 1 returns `cfg`."""
    if size == 1:
        return cfg
    most = max(end - start for start, end in split_layers(cfg.num_hidden_layers, size))
    return dataclasses.replace(cfg, num_hidden_layers=most)


@dataclass(frozen=True)
class StageSpec:
    """One stage: its index among `num_stages` and its layers [start, end)."""

    index: int
    num_stages: int
    start: int
    end: int

    @classmethod
    def of(cls, cfg: ModelConfig, index: int, num_stages: int) -> StageSpec:
        start, end = split_layers(cfg.num_hidden_layers, num_stages)[index]
        return cls(index, num_stages, start, end)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def describe(self) -> str:
        """"stage 1 of 2 (layers 6-11)"."""
        return (f"stage {self.index} of {self.num_stages} (layers {self.start}-"
                f"{self.end - 1})")


class StageLink:
    """Moves hidden states between neighbouring stages (engine/distributed/stage_link.py)."""

    def recv(self, num_tokens: int, hidden_size: int) -> torch.Tensor:
        """The previous stage's [num_tokens, hidden] states."""
        raise NotImplementedError

    def send(self, hidden: torch.Tensor) -> None:
        """This stage's output to the next stage."""
        raise NotImplementedError


class _Absent(nn.Module):
    """Stands in for the embedding or LM head a stage does not hold: no weights (the runner's
    tying of the LM head to the embedding still finds a `weight` attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this pipeline stage does not hold this layer")


class PipelineStageLlama(LlamaForCausalLM):
    """One stage of the decoder. On rank 0 (the last stage, beside the sampler) `driver` first
    sends each forward's step to the other stages, which run the same call. With tensor-parallel
    `groups` of more than one rank (TP x PP), this rank's shard of the stage's layers."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_model_len: int,
                 device: torch.device, stage: StageSpec,
                 groups: ParallelGroups | None = None) -> None:
        self.tp_groups = groups if groups is not None and groups.size > 1 else None
        shapes = cfg if self.tp_groups is None else rank_model_config(cfg, self.tp_groups.size)
        super().__init__(dataclasses.replace(shapes, num_hidden_layers=stage.num_layers),
                         backend, max_model_len, device)
        self.full_config = cfg
        self.stage = stage
        if self.tp_groups is not None:
            shard_modules(self, cfg, backend, self.tp_groups)
        # The first stage embeds; the last one holds the LM head (with tied embeddings the LM
        # head is the embedding matrix, so the last stage keeps that one matrix).
        keeps_embedding = stage.is_first or (stage.is_last and cfg.tie_word_embeddings)
        if not keeps_embedding:
            self.embed_tokens = _Absent()  # type: ignore[assignment]
        if not stage.is_last:
            self.norm = nn.Identity()  # type: ignore[assignment]
            self.lm_head = _Absent()  # type: ignore[assignment]
        self.driver: StepSender | None = None
        self.link: StageLink | None = None

    def launch(self, input_ids: torch.Tensor, positions: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
               ) -> None:
        """Rank 0 under the batch queue: sends the step to the other stages without waiting;
        `forward(..., sent=True)` later runs this stage's part of it."""
        assert self.driver is not None
        self.driver.send_forward(input_ids, positions, kv_caches, meta, wait=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                sent: bool = False) -> torch.Tensor:
        """This stage's layers over the step: the final hidden states on the last stage; on the
        others the states sent on (returned too). `sent`: rank 0 launched the step already."""
        driver = self.driver
        if driver is not None:
            if not sent:  # deferred: the last stage's tensor ranks read it at the finish
                driver.send_forward(input_ids, positions, kv_caches, meta,
                                    wait=not driver.deferred)
            if driver.deferred:
                driver.send_finish()  # this stage's tensor ranks join this step now
        if self.stage.is_first:
            x = self.embed_tokens(input_ids)
        else:
            assert self.link is not None, "a pipeline stage needs its link before a forward"
            x = self.link.recv(input_ids.shape[0], self.config.hidden_size)
        x = self.forward_layers(x, positions, kv_caches, meta)
        if self.stage.is_last:
            return self.norm(x)
        assert self.link is not None
        self.link.send(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's logits; with TP its tensor ranks compute theirs alongside."""
        if self.tp_groups is None:
            return super().compute_logits(hidden)
        if self.driver is not None:
            self.driver.send_logits(hidden)
        return gather_logits(self.lm_head, hidden, self.full_config, self.tp_groups)

    def forward_layers(self, x: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       meta: AttentionMetadata) -> torch.Tensor:
        """Runs this stage's layers (local indices) over the residual stream `x`."""
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads this stage's tensors only: its layers (renumbered), the embedding, the final
        norm and the LM head where the stage holds them (with TP, this rank's slices)."""
        weights = self._stage_weights(weights)
        if self.tp_groups is not None:
            zero_vocab_padding(self)
            weights = shard_weights(weights, self.full_config, self.tp_groups)
        super().load_weights(weights)

    def _stage_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        stage = self.stage
        holds_embedding = not isinstance(self.embed_tokens, _Absent)
        for name, tensor in weights:
            match = _LAYER_NAME.match(name)
            if match is not None:
                index = int(match.group(2))
                if stage.start <= index < stage.end:
                    yield f"model.layers.{index - stage.start}.{match.group(3)}", tensor
                continue
            bare = name.removeprefix("model.")
            if bare.startswith("embed_tokens.") and not holds_embedding:
                continue
            if bare.startswith(("norm.", "lm_head.")) and not stage.is_last:
                continue
            yield name, tensor


def build_stage_model(cfg: ModelConfig, backend: AttentionBackend, max_model_len: int,
                      device: torch.device, stage: StageSpec,
                      groups: ParallelGroups | None = None) -> PipelineStageLlama:
    """`stage`'s part of a Llama, Mistral or Qwen2 decoder (a tensor rank's shard of it when
    `groups` holds more than one)."""
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {cfg.architecture}")
    return PipelineStageLlama(cfg, backend, max_model_len, device, stage, groups)
