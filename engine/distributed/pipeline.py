"""Rank 0's side of a pipeline-parallel engine: spawns the stages 0..N-2 (ranks 1..N-1), forms
the groups, watches the stages' processes and reaps them.

The engine process is rank 0 and the LAST stage (engine/distributed/pp_worker.py explains the
layout): it holds the final layers, the norm and the LM head, so it computes the logits and
samples where the scheduler is, and only hidden states travel between stages. One batch is in
flight across the stages at a time (the stages run one after another within a step). As with
tensor parallelism the rendezvous store listens on a port the OS picks and the groups live under
a name unique to this engine; a stage that exits is noticed before the next step (a step in
flight fails at once: its neighbour's sockets close, and the failure runs down the chain).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import time
import uuid
from multiprocessing.process import BaseProcess

import torch

from engine.config import EngineArgs, ModelConfig
from engine.distributed.launcher import HOST, RankProcesses
from engine.distributed.parallel_state import (
    COLLECTIVE_TIMEOUT,
    ParallelGroups,
    connect_store,
    create_groups,
    threads_per_rank,
)
from engine.distributed.pp_worker import GroupLink, StageRankSpec, run_stage, stage_of_rank
from engine.distributed.tp_worker import StepBroadcaster
from engine.models.pipeline_layers import (
    PipelineStageLlama,
    StageSpec,
    check_pipeline_parallel_size,
)

logger = logging.getLogger("kvserve")


class PipelineParallelLauncher(RankProcesses):
    """Starts and owns stages 0..N-2 of one engine; `groups` is rank 0's view of all N ranks and
    `stage` its own (the last)."""

    KIND = "pipeline-parallel"
    TERMINATE = False  # the stages ignore SIGTERM (see pp_worker.run_stage)

    def __init__(self, args: EngineArgs, model_config: ModelConfig, max_model_len: int,
                 device: torch.device) -> None:
        size = args.pipeline_parallel_size
        check_pipeline_parallel_size(model_config, size)
        if args.quantization not in ("auto", "none") or model_config.checkpoint_quantization:
            raise ValueError("quantized weights (--quantization, AWQ/GPTQ checkpoints) with "
                             "--pipeline-parallel-size > 1 are not supported yet; use one or "
                             "the other (a GGUF file loads dequantized under pipeline "
                             "parallelism)")
        total_threads = args.num_threads or torch.get_num_threads()
        self.num_threads = threads_per_rank(total_threads, size)
        torch.set_num_threads(self.num_threads)
        self.size = size
        self.stage = StageSpec.of(model_config, stage_of_rank(0, size), size)
        self.stages = [StageSpec.of(model_config, stage_of_rank(rank, size), size)
                       for rank in range(size)]
        self.dtype = args.resolved_dtype(device)
        self.prefix = f"kvserve-pp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.store = connect_store(HOST, 0, 0, size)
        self.procs: list[BaseProcess] = []
        self._died: str | None = None
        self._closed = False
        ctx = multiprocessing.get_context("spawn")
        # The stages load in rank 0's dtype, not one they would resolve from `auto` themselves.
        rank_args = dataclasses.replace(args, dtype=str(self.dtype).removeprefix("torch."))
        for rank in range(1, size):
            spec = StageRankSpec(rank_args, max_model_len, rank, size, HOST, self.store.port,
                                 self.prefix, self.num_threads, os.getpid())
            proc = ctx.Process(target=run_stage, args=(spec,), daemon=True,
                               name=f"kvserve-pp-rank{rank}")
            proc.start()
            self.procs.append(proc)
        logger.info("pipeline parallel size %d: %s in this process (rank 0, samples), %s; %d "
                    "CPU threads per rank", size, self.stage.describe(),
                    ", ".join(f"{self.stages[r].describe()} in process {p.pid}"
                              for r, p in enumerate(self.procs, start=1)), self.num_threads)
        if device.type == "cuda":
            device = torch.device("cuda", 0)
        try:
            self._wait_for("joined")
            self.groups: ParallelGroups = create_groups(self.store, self.prefix, 0, size, device)
        except BaseException:
            self.shutdown()
            raise

    def _name(self, rank: int) -> str:
        return f"pipeline-parallel rank {rank} ({self.stages[rank].describe()})"

    def _wait_for(self, key_name: str) -> None:
        """Waits until every rank set `key_name` on the store; raises with a rank's traceback
        (or its exit) instead of waiting for one that failed."""
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        for rank in range(1, self.size):
            key = f"{self.prefix}/{key_name}/{rank}"
            while not self.store.check([key]):
                error = f"{self.prefix}/error/{rank}"
                if self.store.check([error]):
                    raise RuntimeError(f"{self._name(rank)} failed to start:\n"
                                       f"{self.store.get(error).decode()}")
                self.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self._name(rank)} did not reach '{key_name}' within "
                                       f"{COLLECTIVE_TIMEOUT.total_seconds():.0f} s")
                time.sleep(0.01)

    def attach(self, model: torch.nn.Module) -> None:
        """Waits for the other stages' layers, then makes rank 0's stage send each forward and
        receive its input states from the stage before it."""
        assert isinstance(model, PipelineStageLlama)
        try:
            self._wait_for("ready")
        except BaseException:
            self.shutdown()
            raise
        model.driver = StepBroadcaster(self.groups, self.check_alive)
        model.link = GroupLink(self.groups, self.stage, self.dtype)


def start_pipeline_parallel(args: EngineArgs, model_config: ModelConfig, max_model_len: int,
                            device: torch.device) -> PipelineParallelLauncher | None:
    """Spawns stages 0..N-2 for --pipeline-parallel-size N > 1; None for one process."""
    if args.pipeline_parallel_size == 1:
        return None
    return PipelineParallelLauncher(args, model_config, max_model_len, device)
