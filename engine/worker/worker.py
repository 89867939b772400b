"""The worker thread: the one thread that runs the model. The event loop hands it an immutable
batch and gets back a StepResult; the thread owns the weights, the KV tensors and the sampler
(through the model runner) and never touches scheduler state."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from engine.core.scheduler_output import SchedulerOutput, StepResult
from engine.worker.model_runner import ModelRunner


class Worker:
    """Runs batches on the model runner, one at a time, on its own thread."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-worker")

    def submit(self, batch: SchedulerOutput) -> Future[tuple[StepResult, float]]:
        """Starts a step on the worker thread; the future gives (result, forward seconds)."""
        return self._thread.submit(self._execute, batch)

    def _execute(self, batch: SchedulerOutput) -> tuple[StepResult, float]:
        started = time.perf_counter()
        result = self.runner.execute(batch)
        result.forward_seconds = time.perf_counter() - started
        return result, result.forward_seconds

    def shutdown(self) -> None:
        """Waits for the step in flight, then stops the thread."""
        self._thread.shutdown(wait=True)
