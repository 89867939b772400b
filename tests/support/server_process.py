"""Runs a real `kvserve serve` process for end-to-end tests and waits until it is ready.

Built on the project's one server subprocess wrapper, loadtest/serve_process.py (command line,
process group, readiness, SIGTERM-then-SIGKILL stop); this module only adds the tests'
defaults: one torch thread, a log file per server, and a context manager.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.config import EngineArgs
from loadtest.serve_process import (
    RunningServer,
    kvserve_spec,
    start_server,
    stop_server,
    wait_ready,
)

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0
NUM_THREADS = 1  # torch threads per server: the suite runs on 2 cores next to its servers
# --max-body-bytes of the session's capped server (tests/server/conftest.py): small enough that
# a test crosses it cheaply, over HTTP and as a WebSocket message.
MAX_BODY_BYTES = 65536


class ServerProcess:
    """A started server: its URL, process and log file."""

    def __init__(self, running: RunningServer) -> None:
        self.running = running
        self.proc = running.proc
        self.port = running.spec.port
        self.url = running.spec.base_url
        self.log_path = running.spec.log_path

    def log(self) -> str:
        """Everything the server wrote so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit; returns the exit code."""
        return stop_server(self.running)


@contextmanager
def kvserve(model: Path | str, *flags: str, log_dir: Path) -> Iterator[ServerProcess]:
    """Starts `kvserve serve MODEL FLAGS...` on a free port; stops it on exit.

    `--max-num-seqs` is passed at the engine's default and `--dtype float32` (what `auto` is
    on CPUs without native bf16, and what the tests compare against) unless FLAGS set them
    (the later flag wins); each server logs to its own `kvserve-PORT.log` in `log_dir`.
    """
    spec = kvserve_spec(Path(model), NUM_THREADS, EngineArgs().max_num_seqs, log_dir,
                        ["--dtype", "float32", *flags])
    spec = dataclasses.replace(spec, log_path=log_dir / f"kvserve-{spec.port}.log")
    running = start_server(spec)
    server = ServerProcess(running)
    try:
        key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
        wait_ready(running, STARTUP_TIMEOUT_S, api_key=key)
        yield server
    finally:
        server.stop()
