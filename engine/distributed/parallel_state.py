"""Process groups of a tensor-parallel engine and the sizes its ranks split the model by.

No global state: each engine owns its `ParallelGroups`, built straight on a TCPStore under a
per-engine prefix, so two engines (or two test runs) on one host never share a group or a port.
Ranks are laid out as (pipeline stage, tensor rank) with one stage today; a pipeline-parallel
group would be one more `ProcessGroup` per stage built from the same store.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.config import ModelConfig

# Collectives inside a forward: peers are a few milliseconds apart, so a long wait means a rank
# hung (a crashed one closes its sockets and fails the collective at once).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# Ranks 1..N-1 wait for rank 0's next step on the control group for as long as the engine idles.
IDLE_TIMEOUT = datetime.timedelta(days=365)


def valid_tensor_parallel_sizes(cfg: ModelConfig) -> list[int]:
    """Sizes that split this model: they divide the attention heads and the MLP width, and
    divide the KV heads or are a multiple of them (then each KV head is replicated, as vLLM)."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    return [n for n in range(1, heads + 1)
            if heads % n == 0 and cfg.intermediate_size % n == 0
            and (kv % n == 0 or n % kv == 0)]


def check_tensor_parallel_size(cfg: ModelConfig, size: int) -> None:
    """Raises ValueError naming the sizes that work when `size` does not split the model."""
    valid = valid_tensor_parallel_sizes(cfg)
    if size not in valid:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide this model: it has "
            f"{cfg.num_attention_heads} attention heads and {cfg.num_key_value_heads} KV heads "
            f"(intermediate size {cfg.intermediate_size:,}); use one of "
            f"{', '.join(map(str, valid))}")


def kv_heads_per_rank(cfg: ModelConfig, size: int) -> int:
    """KV heads each rank holds: its share, or one replicated head when there are fewer KV
    heads than ranks."""
    return max(1, cfg.num_key_value_heads // size)


def kv_head_start(cfg: ModelConfig, size: int, rank: int) -> int:
    """The first KV head of `rank`'s share (replicated heads: ranks size/kv apart share one)."""
    return rank * cfg.num_key_value_heads // size


def vocab_per_rank(vocab_size: int, size: int) -> int:
    """Rows of the vocab-parallel embedding and LM head per rank (the last rank padded)."""
    return math.ceil(vocab_size / size)


def rank_model_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank holds: its heads, KV heads and MLP width (vocab stays whole: the
    vocab-parallel layers split it themselves). Size 1 returns `cfg`."""
    if size == 1:
        return cfg
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // size,
                               num_key_value_heads=kv_heads_per_rank(cfg, size),
                               intermediate_size=cfg.intermediate_size // size)


def threads_per_rank(total: int, size: int) -> int:
    """Each rank's share of the CPU threads, at least one."""
    return max(1, total // size)


@dataclass
class ParallelGroups:
    """One rank's view: its tensor-parallel rank and size, the device group (NCCL on CUDA, gloo
    on CPU) the model's collectives run on, and the gloo group rank 0 sends steps over."""

    rank: int
    size: int
    device: torch.device
    # gloo / NCCL backends, called directly (torch's stubs type neither their collectives nor
    # their common base), so no process-global default group is ever needed.
    device_group: Any
    cpu_group: Any

    @property
    def is_driver(self) -> bool:
        """Rank 0: beside the scheduler, the one rank that samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; returns it."""
        self.device_group.allreduce([x], dist.ReduceOp.SUM, COLLECTIVE_TIMEOUT).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape on all), in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([parts], [x.contiguous()]).wait(COLLECTIVE_TIMEOUT)
        return parts

    def broadcast(self, x: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """Rank 0's `x` to all (in place). `idle`: the control group's wait for the next step,
        which may last as long as the engine has nothing to do."""
        group = self.cpu_group if x.device.type == "cpu" else self.device_group
        group.broadcast(x, 0, IDLE_TIMEOUT if idle else COLLECTIVE_TIMEOUT).wait()
        return x


def connect_store(host: str, port: int, rank: int, size: int) -> dist.TCPStore:
    """The rendezvous store: rank 0 listens (port 0: a free port the OS picks), others join."""
    return dist.TCPStore(host, port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT,
                         wait_for_workers=False)


def create_groups(store: dist.Store, prefix: str, rank: int, size: int,
                  device: torch.device) -> ParallelGroups:
    """Builds this rank's groups under `prefix` (unique per engine) on the shared store."""
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/cpu/", store), rank, size,
                                      COLLECTIVE_TIMEOUT)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        device_group: Any = dist.ProcessGroupNCCL(
            dist.PrefixStore(f"{prefix}/nccl/", store), rank, size, options)
    else:
        device_group = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/dev/", store), rank,
                                             size, COLLECTIVE_TIMEOUT)
    return ParallelGroups(rank, size, device, device_group, cpu_group)
