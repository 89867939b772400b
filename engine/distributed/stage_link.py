"""Where the pipeline stages live among the world's ranks, and the link that moves hidden states
from one stage to the next.

Rank 0, the engine process beside the scheduler and the sampler, is in the LAST stage (final
norm, LM head, logits: nothing goes back to it but the hidden states it needs anyway). With
TP x PP the world is laid out stage by stage (engine/distributed/parallel_state.py): world rank
w is tensor rank w % TP of pp_index w // TP, where pp_index 0 is the last stage and pp_index
i >= 1 is stage i - 1. So the first stage (the embedding) is pp_index 1 and the hidden states
flow pp_index 1 -> 2 -> ... -> P-1 -> 0, each tensor rank sending its (whole, all-reduced)
states to the same tensor rank of the next stage.
"""

from __future__ import annotations

import torch

from engine.distributed.parallel_state import COLLECTIVE_TIMEOUT, ParallelGroups
from engine.models.pipeline_layers import StageLink, StageSpec


def stage_of_rank(pp_index: int, size: int) -> int:
    """pp_index 0 is the last stage; pp_index r >= 1 is stage r - 1."""
    return size - 1 if pp_index == 0 else pp_index - 1


def rank_of_stage(stage: int, size: int) -> int:
    """The inverse of `stage_of_rank`: a stage's pp_index."""
    return 0 if stage == size - 1 else stage + 1


class GroupLink(StageLink):
    """Point-to-point send/recv of hidden states on the world's device group (gloo on CPU, NCCL
    on CUDA), from this tensor rank's peer in the previous stage and to its peer in the next."""

    TAG = 7

    def __init__(self, groups: ParallelGroups, stage: StageSpec, dtype: torch.dtype) -> None:
        self.groups = groups
        self.dtype = dtype
        size, tp = stage.num_stages, groups.size

        def world_rank(index: int) -> int:
            return rank_of_stage(index, size) * tp + groups.rank

        self.prev = None if stage.is_first else world_rank(stage.index - 1)
        self.next = None if stage.is_last else world_rank(stage.index + 1)

    def recv(self, num_tokens: int, hidden_size: int) -> torch.Tensor:
        assert self.prev is not None
        x = torch.empty(num_tokens, hidden_size, dtype=self.dtype, device=self.groups.device)
        self.groups.world_group.recv([x], self.prev, self.TAG).wait(COLLECTIVE_TIMEOUT)
        return x

    def send(self, hidden: torch.Tensor) -> None:
        assert self.next is not None
        self.groups.world_group.send([hidden.contiguous()], self.next,
                                     self.TAG).wait(COLLECTIVE_TIMEOUT)
