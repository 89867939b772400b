"""The stages other than the last: spawned processes that run rank 0's forwards on their layers.

Ranks and stages: rank 0, the engine process beside the scheduler and the sampler, is the LAST
stage (final norm, LM head, logits: nothing goes back to it but the hidden states it needs
anyway); rank r >= 1 is stage r - 1, so the first stage (the embedding) is rank 1 and the
hidden states flow rank 1 -> 2 -> ... -> N-1 -> 0. Each forward, rank 0 broadcasts the step as
in tensor parallelism (engine/distributed/tp_worker.py: a header of ints, then one packed int64
tensor of token ids, positions, slots, query starts, sequence lengths and block tables); every
stage rebuilds the attention metadata from it, receives its input states from the previous
stage, runs its layers on its own KV cache and sends the output on.
"""

from __future__ import annotations

import os
import signal
import threading
import traceback
from dataclasses import dataclass

import torch

from engine.config import EngineArgs
from engine.distributed.parallel_state import (
    COLLECTIVE_TIMEOUT,
    ParallelGroups,
    connect_store,
    create_groups,
)
from engine.distributed.tp_worker import (
    CMD_FORWARD,
    CMD_SHUTDOWN,
    HEADER_LEN,
    _watch_parent,
    forward_payload_len,
    unpack_forward,
)
from engine.models.pipeline_layers import PipelineStageLlama, StageLink, StageSpec


def stage_of_rank(rank: int, size: int) -> int:
    """Rank 0 is the last stage; rank r >= 1 is stage r - 1."""
    return size - 1 if rank == 0 else rank - 1


def rank_of_stage(stage: int, size: int) -> int:
    """The inverse of `stage_of_rank`."""
    return 0 if stage == size - 1 else stage + 1


class GroupLink(StageLink):
    """Point-to-point send/recv of hidden states on the device group (gloo on CPU, NCCL on
    CUDA), from the previous stage's rank and to the next one's."""

    TAG = 7

    def __init__(self, groups: ParallelGroups, stage: StageSpec, dtype: torch.dtype) -> None:
        self.groups = groups
        self.dtype = dtype
        size = stage.num_stages
        self.prev = None if stage.is_first else rank_of_stage(stage.index - 1, size)
        self.next = None if stage.is_last else rank_of_stage(stage.index + 1, size)

    def recv(self, num_tokens: int, hidden_size: int) -> torch.Tensor:
        assert self.prev is not None
        x = torch.empty(num_tokens, hidden_size, dtype=self.dtype, device=self.groups.device)
        self.groups.device_group.recv([x], self.prev, self.TAG).wait(COLLECTIVE_TIMEOUT)
        return x

    def send(self, hidden: torch.Tensor) -> None:
        assert self.next is not None
        self.groups.device_group.send([hidden.contiguous()], self.next,
                                      self.TAG).wait(COLLECTIVE_TIMEOUT)


@dataclass(frozen=True)
class StageRankSpec:
    """What a spawned stage needs to start (plain values, pickled once at spawn)."""

    args: EngineArgs
    max_model_len: int
    rank: int
    size: int
    host: str
    port: int
    prefix: str  # the engine's unique group namespace on the store
    num_threads: int
    parent_pid: int


def serve_stage(runner: object, groups: ParallelGroups) -> None:
    """Ranks 1..N-1: run rank 0's forwards on this stage until SHUTDOWN (or a failed send,
    receive or broadcast: a dead neighbour closes its sockets, and this rank exits in turn)."""
    from engine.worker.model_runner import ModelRunner

    assert isinstance(runner, ModelRunner) and isinstance(runner.model, PipelineStageLlama)
    model, device = runner.model, groups.device
    while True:
        header = groups.broadcast(torch.zeros(HEADER_LEN, dtype=torch.long), idle=True).tolist()
        if header[0] == CMD_SHUTDOWN:
            return
        if header[0] != CMD_FORWARD:
            raise RuntimeError(f"pipeline stage got an unknown command {header[0]}")
        with torch.inference_mode():
            if not runner.kv_caches or runner.kv_caches[0][0].shape[0] != header[4]:
                runner.allocate_kv_cache(header[4])
            payload = groups.broadcast(torch.empty(forward_payload_len(header),
                                                   dtype=torch.long, device=device))
            input_ids, positions, meta = unpack_forward(header, payload)
            model(input_ids, positions, runner.kv_caches, meta)


def run_stage(spec: StageRankSpec) -> None:
    """Entry point of a spawned stage: join the groups, load its layers, serve forwards."""
    # Ctrl-C and a SIGTERM to the whole process group reach rank 0 too, which drains and then
    # stops the stages; a stage that outlives it exits by itself (_watch_parent).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = spec.host, str(spec.port)
    torch.set_num_threads(spec.num_threads)
    store = connect_store(spec.host, spec.port, spec.rank, spec.size)
    try:
        from engine.model_loader.loader import resolve_model
        from engine.worker.model_runner import ModelRunner

        device = spec.args.resolved_device()
        if device.type == "cuda":
            device = torch.device("cuda", spec.rank)
            torch.cuda.set_device(device)
        torch.manual_seed(spec.args.seed)
        store.set(f"{spec.prefix}/joined/{spec.rank}", "1")
        groups = create_groups(store, spec.prefix, spec.rank, spec.size, device)
        source = resolve_model(spec.args.model)
        stage = StageSpec.of(source.config, stage_of_rank(spec.rank, spec.size), spec.size)
        dtype = spec.args.resolved_dtype(device)
        runner = ModelRunner(source, spec.args, device, dtype, spec.max_model_len, stage=stage)
        assert isinstance(runner.model, PipelineStageLlama)
        runner.model.link = GroupLink(groups, stage, dtype)
    except BaseException:
        store.set(f"{spec.prefix}/error/{spec.rank}", traceback.format_exc())
        raise
    store.set(f"{spec.prefix}/ready/{spec.rank}", "1")
    serve_stage(runner, groups)
