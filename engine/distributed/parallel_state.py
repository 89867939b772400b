"""Process groups of a tensor- and/or pipeline-parallel engine and the sizes its ranks split
the model by.

No global state: each engine owns its `ParallelGroups`, built straight on a TCPStore under a
per-engine prefix, so two engines (or two test runs) on one host never share a group or a port.
The TP x PP world is laid out stage by stage: world rank w is tensor rank w % TP of the stage
whose ranks are w // TP (`pp_index`), and pp_index 0 is the LAST stage, so world rank 0 (the
engine process, beside the scheduler and the sampler) is tensor rank 0 of the stage that holds
the LM head. Each stage's tensor ranks have their own device group for the layers' all-reduces;
the steps and the hidden states between stages go over world-wide groups.
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
from engine.distributed.shm_collectives import ShmCollectives, create_shm_collectives

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


def rank_layout(world_rank: int, tensor_parallel_size: int) -> tuple[int, int]:
    """(pp_index, tensor rank) of a world rank: pp_index 0 is the last stage (the engine's)."""
    return divmod(world_rank, tensor_parallel_size)


def threads_per_rank(total: int, size: int) -> int:
    """Each rank's share of the CPU threads, at least one."""
    return max(1, total // size)


@dataclass
class ParallelGroups:
    """One rank's view: its tensor-parallel rank and size within its stage, the stage's device
    group (NCCL on CUDA, gloo on CPU) the layers' collectives run on, the world-wide gloo group
    rank 0 sends the steps' headers over, and the world-wide device group for the steps'
    payloads and the hidden states passed between stages."""

    rank: int
    size: int
    device: torch.device
    # gloo / NCCL backends, called directly (torch's stubs type neither their collectives nor
    # their common base), so no process-global default group is ever needed.
    device_group: Any  # this stage's tensor ranks (None with one per stage: never called)
    cpu_group: Any
    world_group: Any
    world_rank: int = 0
    world_size: int = 1
    # The stage's shared-memory all-reduce and all-gather (CPU, one host); None: gloo only.
    shm: ShmCollectives | None = None
    # TP x PP with the batch queue: the last stage's tensor ranks' own control group (gloo),
    # which rank 0 drives in step with its finishes (rank_worker.py); None elsewhere.
    last_stage_group: Any = None

    @property
    def is_driver(self) -> bool:
        """World rank 0: beside the scheduler, the one rank that samples."""
        return self.world_rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; returns it."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        self.device_group.allreduce([x], dist.ReduceOp.SUM, COLLECTIVE_TIMEOUT).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape on all), in rank order."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([parts], [x.contiguous()]).wait(COLLECTIVE_TIMEOUT)
        return parts

    def broadcast(self, x: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """World rank 0's `x` to all (in place). `idle`: the control group's wait for the next
        step, which may last as long as the engine has nothing to do."""
        self.broadcast_async(x, idle).wait()
        return x

    def broadcast_last_stage(self, x: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """World rank 0's `x` to the last stage's tensor ranks only (in place)."""
        group = self.last_stage_group if x.device.type == "cpu" else self.device_group
        group.broadcast(x, 0, IDLE_TIMEOUT if idle else COLLECTIVE_TIMEOUT).wait()
        return x

    def broadcast_async(self, x: torch.Tensor, idle: bool = False) -> Any:
        """Starts `broadcast`; returns its work (`x` must live until the work completes)."""
        group = self.cpu_group if x.device.type == "cpu" else self.world_group
        return group.broadcast(x, 0, IDLE_TIMEOUT if idle else COLLECTIVE_TIMEOUT)


def connect_store(host: str, port: int, rank: int, size: int) -> dist.TCPStore:
    """The rendezvous store: rank 0 listens (port 0: a free port the OS picks), others join."""
    return dist.TCPStore(host, port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT,
                         wait_for_workers=False)


def _device_group(store: dist.Store, name: str, rank: int, size: int,
                  device: torch.device) -> Any:
    """A group of `size` ranks under `name`: NCCL on CUDA, gloo otherwise."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(dist.PrefixStore(f"{name}/nccl/", store), rank, size,
                                     options)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/dev/", store), rank, size,
                                 COLLECTIVE_TIMEOUT)


def create_groups(store: dist.Store, prefix: str, world_rank: int, tensor_parallel_size: int,
                  pipeline_parallel_size: int, device: torch.device,
                  deferred_last_stage: bool = False) -> ParallelGroups:
    """Builds this rank's groups under `prefix` (unique per engine) on the shared store: the
    world's control and device groups, its stage's tensor-parallel group, and with
    `deferred_last_stage` (TP x PP under the batch queue) the last stage's control group."""
    world_size = tensor_parallel_size * pipeline_parallel_size
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/cpu/", store), world_rank,
                                      world_size, COLLECTIVE_TIMEOUT)
    world_group = _device_group(store, prefix, world_rank, world_size, device)
    pp_index, tp_rank = rank_layout(world_rank, tensor_parallel_size)
    if pipeline_parallel_size == 1:
        tp_group = world_group
    elif tensor_parallel_size > 1:
        tp_group = _device_group(store, f"{prefix}/stage{pp_index}", tp_rank,
                                 tensor_parallel_size, device)
    else:
        tp_group = None
    shm = create_shm_collectives(store, prefix, pp_index, tp_rank, tensor_parallel_size,
                                 COLLECTIVE_TIMEOUT.total_seconds()) \
        if device.type == "cpu" else None
    last_stage = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/last/", store), tp_rank,
                                       tensor_parallel_size, COLLECTIVE_TIMEOUT) \
        if deferred_last_stage and pp_index == 0 else None
    return ParallelGroups(tp_rank, tensor_parallel_size, device, tp_group, cpu_group,
                          world_group, world_rank, world_size, shm, last_stage)
