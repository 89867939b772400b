"""The worker thread: the one thread that runs the model. The event loop hands it an immutable
batch and gets back a StepResult; the thread owns the weights, the KV tensors and the sampler
(through the model runner) and never touches scheduler state.

The thread is started before the model exists, and loading, profiling and KV allocation run on
it too (`call`): with torch's OpenMP build every thread that enters a parallel region keeps its
own team of worker threads for good, and once two teams exist on a machine with no spare cores
libgomp stops spinning and puts its threads to sleep between regions. Measured on 2 cores
(bf16 GEMV of SmolLM2's gate/up shape, 2 threads): 59 us from the only team's thread, 116 us
from either thread once a second team exists; a whole SmolLM2 decode step went from 13.5 ms to
24 ms when the model loaded on the caller's thread and stepped here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from engine.core.scheduler_output import SchedulerOutput, StepResult
from engine.worker.model_runner import ModelRunner

T = TypeVar("T")


class Worker:
    """Runs batches on the model runner, one at a time, on its own thread."""

    def __init__(self, num_threads: int | None = None) -> None:
        self.runner: ModelRunner | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-worker")
        self.thread_id = self.call(_thread_setup, num_threads)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Runs `fn(*args)` on the worker thread and returns its result (or raises its error):
        for the torch work outside steps (loading, profiling, KV allocation)."""
        return self._thread.submit(fn, *args).result()

    def attach(self, runner: ModelRunner) -> None:
        """The runner `submit` steps on (built on this thread through `call`)."""
        self.runner = runner

    def submit(self, batch: SchedulerOutput) -> Future[tuple[StepResult, float]]:
        """Starts a step on the worker thread; the future gives (result, forward seconds)."""
        return self._thread.submit(self._execute, batch)

    def launch(self, batch: SchedulerOutput) -> Future[None]:
        """Pipeline parallel batch queue: sends the batch to the stages on the worker thread
        (ModelRunner.launch); `finish` later gives its result."""
        assert self.runner is not None, "Worker.attach(runner) comes before the first step"
        return self._thread.submit(self.runner.launch, batch)

    def finish(self, batch: SchedulerOutput, launched: Future[None]
               ) -> Future[tuple[StepResult, float]]:
        """The result of a launched batch: rank 0's stage runs it after what is queued."""
        return self._thread.submit(self._finish, batch, launched)

    def _finish(self, batch: SchedulerOutput, launched: Future[None]
                ) -> tuple[StepResult, float]:
        assert self.runner is not None
        launched.result()  # done (the thread runs in order); raises the launch's error
        started = time.perf_counter()
        result = self.runner.finish(batch)
        result.forward_seconds = time.perf_counter() - started
        return result, result.forward_seconds

    def _execute(self, batch: SchedulerOutput) -> tuple[StepResult, float]:
        assert self.runner is not None, "Worker.attach(runner) comes before the first step"
        started = time.perf_counter()
        result = self.runner.execute(batch)
        result.forward_seconds = time.perf_counter() - started
        return result, result.forward_seconds

    def shutdown(self) -> None:
        """Waits for the step in flight, then stops the thread."""
        self._thread.shutdown(wait=True)


def _thread_setup(num_threads: int | None) -> int:
    # OpenMP's thread count is per calling thread: the caller's setting does not reach here.
    if num_threads:
        torch.set_num_threads(num_threads)
    import threading
    return threading.get_ident()
