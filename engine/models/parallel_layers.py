"""Tensor-parallel Llama: each rank holds a shard and the ranks sum or gather at four points.

Megatron's split, as vLLM does it: the fused q/k/v and gate/up projections are column-parallel
(each rank computes its heads and its slice of the MLP width, no communication), o_proj and
down_proj are row-parallel (each rank's partial product, then one all-reduce), the embedding is
vocab-parallel (each rank looks up its rows, zeros elsewhere, all-reduce) and so is the LM head
(each rank's vocab slice of the logits, gathered for rank 0's sampler). The linears stay plain
`nn.Linear`s of shard shape, so packing and weight loading treat them as in one process; the
collectives live in the blocks around them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.parallel_state import (
    ParallelGroups,
    kv_head_start,
    rank_model_config,
    vocab_per_rank,
)
from engine.models.llama import MLP, Attention, LlamaForCausalLM
from kernels.metadata import AttentionBackend, AttentionMetadata


class RowParallelAttention(Attention):
    """This rank's heads; o_proj's partial sums are all-reduced."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 groups: ParallelGroups) -> None:
        super().__init__(cfg, backend)
        self.groups = groups

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        return self.groups.all_reduce(super().forward(x, cos, sin, kv_cache, meta))


class RowParallelMLP(MLP):
    """This rank's slice of the MLP width; down_proj's partial sums are all-reduced."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__(cfg)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.groups.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + rows) of the embedding; other ids look up zeros, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, groups: ParallelGroups) -> None:
        rows = vocab_per_rank(vocab_size, groups.size)
        super().__init__(rows, hidden_size)  # weight: [rows, hidden]
        self.start = groups.rank * rows
        self.groups = groups

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> [num_tokens, hidden]."""
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        x = x * inside.unsqueeze(-1).to(x.dtype)
        return self.groups.all_reduce(x)


def shard_modules(model: LlamaForCausalLM, cfg: ModelConfig, backend: AttentionBackend,
                  groups: ParallelGroups) -> None:
    """Turns a model built with one rank's shapes (`rank_model_config`) into that rank's shard:
    row-parallel attention and MLP blocks, a vocab-parallel embedding and LM head."""
    shard = model.config
    for layer in model.layers:
        assert isinstance(layer, nn.Module)
        layer.self_attn = RowParallelAttention(shard, backend, groups)
        layer.mlp = RowParallelMLP(shard, groups)
    model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, groups)
    model.lm_head = nn.Linear(cfg.hidden_size, model.embed_tokens.weight.shape[0], bias=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def gather_logits(lm_head: nn.Module, hidden: torch.Tensor, cfg: ModelConfig,
                  groups: ParallelGroups) -> torch.Tensor:
    """[num_rows, hidden] -> float32 logits [num_rows, vocab], whole on every tensor rank."""
    local = lm_head(hidden).float()  # [num_rows, vocab / size]
    logits = torch.cat(groups.all_gather(local), dim=-1)
    return logits[:, :cfg.vocab_size]


def zero_vocab_padding(model: LlamaForCausalLM) -> None:
    """Zeroes the vocab-parallel rows before loading, so the last rank's padding rows stay 0."""
    with torch.no_grad():
        for module in (model.embed_tokens, model.lm_head):
            weight = getattr(module, "weight", None)
            if weight is not None:
                weight.zero_()


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig,
                  groups: ParallelGroups) -> Iterator[tuple[str, torch.Tensor]]:
    """Each HF tensor cut to `groups.rank`'s part (norms replicated)."""
    shard, rank, size = rank_model_config(cfg, groups.size), groups.rank, groups.size
    hd = cfg.head_dim
    for name, tensor in weights:
        if ".q_proj." in name:
            part = _rows(tensor, rank * shard.num_attention_heads * hd,
                         shard.num_attention_heads * hd)
        elif ".k_proj." in name or ".v_proj." in name:
            first = kv_head_start(cfg, size, rank)
            part = _rows(tensor, first * hd, shard.num_key_value_heads * hd)
        elif ".gate_proj." in name or ".up_proj." in name:
            part = _rows(tensor, rank * shard.intermediate_size, shard.intermediate_size)
        elif ".o_proj." in name:
            width = shard.num_attention_heads * hd
            part = tensor[:, rank * width:(rank + 1) * width]
        elif ".down_proj." in name:
            width = shard.intermediate_size
            part = tensor[:, rank * width:(rank + 1) * width]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = vocab_per_rank(cfg.vocab_size, size)
            part = _rows(tensor, rank * rows, rows)
        else:
            part = tensor  # norms: replicated
        yield name, part


class TensorParallelLlama(LlamaForCausalLM):
    """One rank's shard of the decoder. On rank 0, `driver` first sends each forward and LM head
    call to the other ranks (engine/distributed/rank_worker.py), which run the same calls."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_model_len: int,
                 device: torch.device, groups: ParallelGroups) -> None:
        super().__init__(rank_model_config(cfg, groups.size), backend, max_model_len, device)
        self.full_config = cfg
        self.groups = groups
        shard_modules(self, cfg, backend, groups)
        self.driver: StepSender | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                ) -> torch.Tensor:
        """As LlamaForCausalLM's; on rank 0 the step goes to the other ranks first."""
        if self.driver is not None:
            self.driver.send_forward(input_ids, positions, kv_caches, meta)
        return super().forward(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> float32 logits [num_rows, vocab], whole on every rank."""
        if self.driver is not None:
            self.driver.send_logits(hidden)
        return gather_logits(self.lm_head, hidden, self.full_config, self.groups)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads this rank's slice of each HF tensor (padding rows of the vocab zeroed)."""
        zero_vocab_padding(self)
        super().load_weights(shard_weights(weights, self.full_config, self.groups))


def _rows(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """tensor[start:start + count] along dim 0 (a bias or a weight)."""
    return tensor[start:start + count]


class StepSender:
    """What rank 0's model calls to send a step: implemented in engine/distributed/rank_worker.py
    (here only its shape, so the model does not import the process layer)."""

    # TP x PP under the batch queue: the last stage's tensor ranks run a step at its finish.
    deferred = False

    def send_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     meta: AttentionMetadata, wait: bool = True) -> None:
        """Sends a forward's inputs to the other ranks (`wait=False`: without waiting for them
        to take it)."""
        raise NotImplementedError

    def send_logits(self, hidden: torch.Tensor) -> None:
        """Sends the rows to compute logits for to the other ranks."""
        raise NotImplementedError

    def send_finish(self) -> None:
        """Batch queue with TP x PP: the last stage's tensor ranks run the oldest launch."""
        raise NotImplementedError
