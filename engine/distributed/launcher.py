"""Rank 0's side of a tensor-parallel engine: spawns ranks 1..N-1, forms the groups, watches
the ranks' processes and reaps them.

The engine process is rank 0 (beside the scheduler, the only rank that samples). Each other
rank is a `multiprocessing` spawn child running engine/distributed/tp_worker.py. The
rendezvous store listens on a port the OS picks and every group lives under a name unique to
this engine, so engines and test runs on one host never meet. A rank that exits is noticed
before the next step is sent (and a step in flight fails at once: its peer's sockets close);
the engine then refuses further steps with RankDiedError.
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
    threads_per_rank,
)
from engine.distributed.tp_worker import RankSpec, StepBroadcaster, run_rank
from engine.models.parallel_layers import TensorParallelLlama

logger = logging.getLogger("kvserve")
HOST = "127.0.0.1"
JOIN_SECONDS = 5.0  # per rank, to exit after SHUTDOWN before it is terminated


class RankDiedError(RuntimeError):
    """A tensor-parallel rank's process exited: the engine cannot run another step."""


class RankProcesses:
    """The spawned ranks' side shared by the tensor- and pipeline-parallel launchers: noticing
    a rank that exited and stopping them all. Subclasses set `procs`, `_died`, `_closed`,
    `groups` (once formed) and name their ranks."""

    procs: list[BaseProcess]
    _died: str | None
    _closed: bool
    KIND = "tensor-parallel"
    # Whether shutdown tries SIGTERM before SIGKILL (pipeline stages ignore SIGTERM).
    TERMINATE = True

    def _name(self, rank: int) -> str:
        raise NotImplementedError

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

    def shutdown(self) -> None:
        """Stops every rank: SHUTDOWN to live ones, then terminate and kill what stays."""
        if self._closed:
            return
        groups = getattr(self, "groups", None)
        if groups is not None and self.dead_rank() is None:
            try:
                StepBroadcaster(groups, self.check_alive).send_shutdown()
            except Exception:  # a rank died meanwhile: terminate below
                logger.warning("%s shutdown: a rank did not take SHUTDOWN", self.KIND)
        self._closed = True
        for proc in self.procs:
            proc.join(JOIN_SECONDS)
            if proc.is_alive() and self.TERMINATE:
                proc.terminate()
                proc.join(JOIN_SECONDS)
            if proc.is_alive():
                proc.kill()
                proc.join()


class TensorParallelLauncher(RankProcesses):
    """Starts and owns ranks 1..N-1 of one engine; `groups` is rank 0's view."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, max_model_len: int,
                 device: torch.device) -> None:
        size = args.tensor_parallel_size
        check_tensor_parallel_size(model_config, size)
        if args.quantization not in ("auto", "none") or model_config.checkpoint_quantization:
            raise ValueError("quantized weights (--quantization, AWQ/GPTQ checkpoints) with "
                             "--tensor-parallel-size > 1 are not supported yet; use one or the "
                             "other (a GGUF file loads dequantized under tensor parallelism)")
        total_threads = args.num_threads or torch.get_num_threads()
        self.num_threads = threads_per_rank(total_threads, size)
        torch.set_num_threads(self.num_threads)
        self.size = size
        self.prefix = f"kvserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.store = connect_store(HOST, 0, 0, size)
        self.procs: list[BaseProcess] = []
        self._died: str | None = None
        self._closed = False
        ctx = multiprocessing.get_context("spawn")
        # The ranks load in rank 0's dtype, not one they would resolve from `auto` themselves.
        dtype_name = str(args.resolved_dtype(device)).removeprefix("torch.")
        rank_args = dataclasses.replace(args, dtype=dtype_name)
        for rank in range(1, size):
            spec = RankSpec(rank_args, max_model_len, rank, size, HOST, self.store.port,
                            self.prefix, self.num_threads, os.getpid())
            proc = ctx.Process(target=run_rank, args=(spec,), daemon=True,
                               name=f"kvserve-tp-rank{rank}")
            proc.start()
            self.procs.append(proc)
        logger.info("tensor parallel size %d: rank 0 in this process, ranks 1..%d in processes "
                    "%s; %d CPU threads per rank", size, size - 1,
                    ", ".join(str(p.pid) for p in self.procs), self.num_threads)
        if device.type == "cuda":
            device = torch.device("cuda", 0)
        try:
            self._wait_for("joined")
            self.groups: ParallelGroups = create_groups(self.store, self.prefix, 0, size, device)
        except BaseException:
            self.shutdown()
            raise

    def _wait_for(self, stage: str) -> None:
        """Waits until every rank set `stage` on the store; raises with a rank's traceback (or
        its exit) instead of waiting for one that failed."""
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        for rank in range(1, self.size):
            key = f"{self.prefix}/{stage}/{rank}"
            while not self.store.check([key]):
                error = f"{self.prefix}/error/{rank}"
                if self.store.check([error]):
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n"
                                       f"{self.store.get(error).decode()}")
                self.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not reach '{stage}' "
                                       f"within {COLLECTIVE_TIMEOUT.total_seconds():.0f} s")
                time.sleep(0.01)

    def attach(self, model: torch.nn.Module) -> None:
        """Waits for the other ranks' shards, then makes rank 0's model send each call."""
        assert isinstance(model, TensorParallelLlama)
        try:
            self._wait_for("ready")
        except BaseException:
            self.shutdown()
            raise
        model.driver = StepBroadcaster(self.groups, self.check_alive)

    def _name(self, rank: int) -> str:
        return f"tensor-parallel rank {rank}"


def start_tensor_parallel(args: EngineArgs, model_config: ModelConfig, max_model_len: int,
                          device: torch.device) -> TensorParallelLauncher | None:
    """Spawns ranks 1..N-1 for --tensor-parallel-size N > 1; None for one process."""
    if args.tensor_parallel_size == 1:
        return None
    return TensorParallelLauncher(args, model_config, max_model_len, device)
