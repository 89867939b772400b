"""Rank 0's side of a tensor-, pipeline- or TP x PP-parallel engine: spawns the other ranks,
forms the groups, watches the ranks' processes and reaps them.

The engine process is world rank 0: tensor rank 0 of the last pipeline stage, beside the
scheduler and the only rank that samples (engine/distributed/parallel_state.py lays out the
rest). Each other rank is a `multiprocessing` spawn child running
engine/distributed/rank_worker.py. The rendezvous store listens on a port the OS picks and every
group lives under a name unique to this engine, so engines and test runs on one host never meet.
A rank that exits is noticed before the next step is sent (and a step in flight fails at once:
its peers' sockets close, and the failure runs through the stages); the engine then refuses
further steps with RankDiedError. Under pipeline parallelism the engine keeps a batch per stage
in flight (the batch queue: engine/core/async_scheduler.py, ModelRunner.launch/finish).
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
from engine.distributed.parallel_state import (
    COLLECTIVE_TIMEOUT,
    ParallelGroups,
    check_tensor_parallel_size,
    connect_store,
    create_groups,
    rank_layout,
    threads_per_rank,
)
from engine.distributed.rank_worker import (
    RankSpec,
    StepBroadcaster,
    deferred_last_stage,
    run_rank,
)
from engine.distributed.stage_link import GroupLink, stage_of_rank
from engine.models.parallel_layers import TensorParallelLlama
from engine.models.pipeline_layers import (
    PipelineStageLlama,
    StageSpec,
    check_pipeline_parallel_size,
)

logger = logging.getLogger("kvserve")
HOST = "127.0.0.1"
JOIN_SECONDS = 5.0  # per rank, to exit after SHUTDOWN before it is killed


class RankDiedError(RuntimeError):
    """A tensor- or pipeline-parallel rank's process exited: the engine cannot run another
    step."""


class ParallelLauncher:
    """Starts and owns world ranks 1..TP x PP - 1 of one engine; `groups` is rank 0's view and
    `stage` its pipeline stage (the last; None without pipeline parallelism)."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, max_model_len: int,
                 device: torch.device) -> None:
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        check_tensor_parallel_size(model_config, tp)
        check_pipeline_parallel_size(model_config, pp)
        if args.quantization not in ("auto", "none") or model_config.checkpoint_quantization:
            raise ValueError("quantized weights (--quantization, AWQ/GPTQ checkpoints) with "
                             "--tensor-parallel-size or --pipeline-parallel-size > 1 are not "
                             "supported yet; use one or the other (a GGUF file loads "
                             "dequantized under tensor or pipeline parallelism)")
        self.tensor_parallel_size, self.pipeline_parallel_size = tp, pp
        self.deferred = deferred_last_stage(args)  # TP x PP under the batch queue
        self.size = tp * pp
        self.kind = " x ".join(
            [name for name, n in (("tensor-parallel", tp), ("pipeline-parallel", pp)) if n > 1])
        total_threads = args.num_threads or torch.get_num_threads()
        self.num_threads = threads_per_rank(total_threads, self.size)
        torch.set_num_threads(self.num_threads)
        self.stages = [StageSpec.of(model_config, index, pp) for index in range(pp)] \
            if pp > 1 else []
        self.stage = self.stages[-1] if self.stages else None
        self.dtype = args.resolved_dtype(device)
        self.prefix = f"kvserve-par-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.store = connect_store(HOST, 0, 0, self.size)
        self.procs: list[BaseProcess] = []
        self._died: str | None = None
        self._closed = False
        ctx = multiprocessing.get_context("spawn")
        # The ranks load in rank 0's dtype, not one they would resolve from `auto` themselves.
        rank_args = dataclasses.replace(args, dtype=str(self.dtype).removeprefix("torch."))
        for rank in range(1, self.size):
            spec = RankSpec(rank_args, max_model_len, rank, tp, pp, HOST, self.store.port,
                            self.prefix, self.num_threads, os.getpid())
            proc = ctx.Process(target=run_rank, args=(spec,), daemon=True,
                               name=f"kvserve-rank{rank}")
            proc.start()
            self.procs.append(proc)
        logger.info("%s: %s in this process (rank 0, samples), %s; %d CPU threads per rank",
                    self._sizes(), self._what(0), ", ".join(
                        f"{self._what(r)} in process {p.pid} (rank {r})"
                        for r, p in enumerate(self.procs, start=1)), self.num_threads)
        if device.type == "cuda":
            device = torch.device("cuda", 0)
        try:
            self._wait_for("joined")
            self.groups: ParallelGroups = create_groups(self.store, self.prefix, 0, tp, pp,
                                                        device, self.deferred)
        except BaseException:
            self.shutdown()
            raise

    def _sizes(self) -> str:
        """"tensor parallel size 2 x pipeline parallel size 2"."""
        return " x ".join(f"{name} parallel size {n}" for name, n in
                          (("tensor", self.tensor_parallel_size),
                           ("pipeline", self.pipeline_parallel_size)) if n > 1)

    def _what(self, rank: int) -> str:
        """What world rank `rank` holds: "tensor rank 1 of stage 0 of 2 (layers 0-0)"."""
        pp_index, tp_rank = rank_layout(rank, self.tensor_parallel_size)
        parts = []
        if self.tensor_parallel_size > 1:
            parts.append(f"tensor rank {tp_rank}")
        if self.stages:
            parts.append(self.stages[stage_of_rank(pp_index, self.pipeline_parallel_size)]
                         .describe())
        return " of ".join(parts)

    def _name(self, rank: int) -> str:
        return f"{self.kind} rank {rank} ({self._what(rank)})"

    def dead_rank(self) -> str | None:
        """Why the engine cannot step any more (a rank exited), or None while all live."""
        if self._died is None and not self._closed:
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    self._died = (f"{self._name(rank)} (pid {proc.pid}) exited with code "
                                  f"{proc.exitcode}")
                    logger.error("%s: the engine cannot run more steps", self._died)
                    break
        return self._died

    def check_alive(self) -> None:
        """Raises RankDiedError when a rank has exited."""
        reason = self.dead_rank()
        if reason is not None:
            raise RankDiedError(reason)

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
        """Waits for the other ranks' parts, then makes rank 0's model send each call (and,
        with stages, receive its input states from the stage before it)."""
        try:
            self._wait_for("ready")
        except BaseException:
            self.shutdown()
            raise
        driver = StepBroadcaster(self.groups, self.check_alive, self.deferred)
        if self.stage is not None:
            assert isinstance(model, PipelineStageLlama)
            model.link = GroupLink(self.groups, self.stage, self.dtype)
        else:
            assert isinstance(model, TensorParallelLlama)
        model.driver = driver

    def shutdown(self) -> None:
        """Stops every rank: SHUTDOWN to live ones, then kill what stays (the ranks ignore
        SIGTERM, which a process group's stop sends them too)."""
        if self._closed:
            return
        groups = getattr(self, "groups", None)
        told = False
        if groups is not None and self.dead_rank() is None:
            try:
                StepBroadcaster(groups, self.check_alive, self.deferred).send_shutdown()
                told = True
            except Exception:  # a rank died meanwhile: kill below
                logger.warning("%s shutdown: a rank did not take SHUTDOWN", self.kind)
        self._closed = True
        for proc in self.procs:  # untold ranks wait for a step that never comes: kill them
            proc.join(JOIN_SECONDS if told else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()


def start_parallel(args: EngineArgs, model_config: ModelConfig, max_model_len: int,
                   device: torch.device) -> ParallelLauncher | None:
    """Spawns the other ranks for --tensor-parallel-size and/or --pipeline-parallel-size > 1;
    None for one process."""
    if args.tensor_parallel_size == 1 and args.pipeline_parallel_size == 1:
        return None
    return ParallelLauncher(args, model_config, max_model_len, device)
