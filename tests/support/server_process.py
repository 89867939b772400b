"""Runs a real `kvserve serve` process for end-to-end tests and waits until it is ready."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    """A port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """A started server: its URL, process and log file."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        """Everything the server wrote so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Polls /health until 200; fails with the log tail if the process dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"kvserve did not become ready in {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


@contextmanager
def kvserve(model: Path | str, *flags: str, log_dir: Path) -> Iterator[ServerProcess]:
    """Starts `kvserve serve MODEL FLAGS...` on a free port; stops it on exit."""
    port = free_port()
    log_path = log_dir / f"kvserve-{port}.log"
    cmd = [sys.executable, "-m", "server.cli", "serve", str(model), "--port", str(port),
           "--num-threads", "1", *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    server = ServerProcess(proc, port, log_path)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def assert_error_body(body: Any, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: exactly message, type, param and code under "error"."""
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param
    return dict(error)


def server_metrics(url: str) -> dict[str, float | None]:
    """The server's /metrics page, parsed by the load harness (running, waiting,
    kv_cache_usage, preemptions, prefix-cache counters)."""
    from loadtest.scrape import parse_metrics

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


def wait_idle(url: str, timeout: float = 15.0) -> dict[str, float | None]:
    """Polls /metrics until nothing runs or waits and KV usage is exactly 0 (the gauge is
    1 - free / total blocks, so 0.0 means every block is free); returns that page."""
    deadline = time.monotonic() + timeout
    while True:
        page = server_metrics(url)
        busy = (page["running"], page["waiting"], page["kv_cache_usage"])
        if busy == (0.0, 0.0, 0.0):
            return page
        assert time.monotonic() < deadline, f"still busy (running, waiting, usage) = {busy}"
        time.sleep(0.05)
