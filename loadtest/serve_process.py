"""Server subprocesses (the one wrapper, for the benchmarks, the soak run and the tests): the
kvserve and peer command lines, start, readiness, CPU accounting and stop, plus the setup of
the peer's own virtualenv.

The peer (`transformers serve`) runs from a separate venv, `.venv-bench`, so its extra
dependencies (FastAPI, uvicorn, the openai SDK pinned by transformers) never touch the
project's venv; see `setup_peer_venv` for the exact install steps.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".venv-bench"
TORCH_VERSION = "2.13.0"  # the CPU build on local disk; the same as the project's venv
TRANSFORMERS_VERSION = "5.24.0"  # the same as the project's venv


@dataclass
class ServerSpec:
    """How to start one server: its name, argv (the port is already in it), environment."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    # Body fields only this server understands (e.g. how to ignore EOS).
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:<port>."""
        return f"http://127.0.0.1:{self.port}"

    def command_line(self) -> str:
        """The command as a user would type it, with its thread variables."""
        prefix = " ".join(f"{k}={v}" for k, v in self.env.items() if k in THREAD_VARS)
        line = f"{prefix} {' '.join(self.argv)}".strip()
        # Paths relative to the repository and home, so the line reads the same anywhere.
        return line.replace(str(ROOT) + os.sep, "").replace(str(Path.home()), "~")


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HUB_OFFLINE")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def thread_env(threads: int) -> dict[str, str]:
    """The process environment with intra-op threads capped and the hub offline; torch
    reads OMP_NUM_THREADS at start, which is the only thread knob `transformers serve` has."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def kvserve_spec(model: Path | None, threads: int, max_num_seqs: int, log_dir: Path,
                 extra_args: list[str], name: str = "kvserve") -> ServerSpec:
    """`python -m server.cli serve` from the project's venv; `model=None` serves the
    embedded default model; `name` labels it in reports and names its log."""
    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "serve", *([] if model is None else [str(model)]),
            "--host", "127.0.0.1", "--port", str(port), "--num-threads", str(threads),
            "--max-num-seqs", str(max_num_seqs), *extra_args]
    env = thread_env(threads)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return ServerSpec(name, argv, env, port, log_dir / f"{name}_serve.log",
                      extra_body={"ignore_eos": True})


def peer_spec(model: Path, threads: int, log_dir: Path, extra_args: list[str]) -> ServerSpec:
    """`transformers serve --continuous-batching` from .venv-bench, pinned to the folder
    (so it is preloaded), on CPU in float32."""
    port = free_port()
    argv = [str(PEER_VENV / "bin" / "transformers"), "serve", str(model),
            "--continuous-batching", "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *extra_args]
    # It rejects unknown fields such as `ignore_eos` (HTTP 422) but takes a per-request
    # `generation_config` JSON; continuous batching honours its eos_token_id, and -1 never
    # matches a token, so generation runs to max_tokens as with kvserve's ignore_eos.
    gen_config = orjson.dumps({"eos_token_id": -1, "do_sample": False}).decode()
    return ServerSpec("transformers", argv, thread_env(threads), port,
                      log_dir / "transformers_serve.log",
                      extra_body={"generation_config": gen_config})


# ---- lifecycle ----------------------------------------------------------------------------


@dataclass
class RunningServer:
    """A started server: the process and its open log file."""

    spec: ServerSpec
    proc: subprocess.Popen[bytes]
    log: IO[bytes]

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log, for error messages."""
        self.log.flush()
        text = self.spec.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def start_server(spec: ServerSpec) -> RunningServer:
    """Starts the server in its own process group (so stopping it reaches its children)."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    log = spec.log_path.open("wb")
    try:
        proc = subprocess.Popen(spec.argv, env=spec.env, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError:  # no such program, say: nothing to stop later
        log.close()
        raise
    return RunningServer(spec, proc, log)


def _get_json(url: str, timeout: float = 5.0, api_key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 (loopback)
        return orjson.loads(resp.read())


def wait_ready(server: RunningServer, deadline_s: float, api_key: str | None = None) -> str:
    """Polls GET /v1/models (with the server's --api-key, if it has one) until it lists a model
    and returns that model's id. Raises with the log tail when the process exits or the
    deadline passes first."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.spec.name} exited with code {server.proc.returncode} "
                               f"before it was ready; log {server.spec.log_path}:\n"
                               f"{server.log_tail()}")
        try:
            models = _get_json(server.spec.base_url + "/v1/models", api_key=api_key)
            if models.get("data"):
                return str(models["data"][0]["id"])
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass  # not listening yet, or still loading
        time.sleep(0.5)
    raise TimeoutError(f"{server.spec.name} not ready after {deadline_s:.0f} s; log "
                       f"{server.spec.log_path}:\n{server.log_tail()}")


def stop_server(server: RunningServer, grace_s: float = 15.0) -> int | None:
    """SIGTERM to the process group, SIGKILL if it outlives `grace_s`; returns the exit code."""
    proc = server.proc
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(grace_s)
    except ProcessLookupError:
        pass  # already gone
    finally:
        server.log.close()
    return proc.returncode


@contextmanager
def serving(spec: ServerSpec, ready_timeout_s: float = 300.0
            ) -> Iterator[tuple[RunningServer, str]]:
    """Starts the server, waits until it is ready and yields it with its model id; stops it
    on exit, whatever happened."""
    server = start_server(spec)
    try:
        yield server, wait_ready(server, ready_timeout_s)
    finally:
        stop_server(server)


def process_tree_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` and its live descendants (Linux), or None."""
    try:
        stats = {int(p.name): (p / "stat").read_text() for p in Path("/proc").iterdir()
                 if p.name.isdigit() and (p / "stat").exists()}
    except OSError:
        return None
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for child, text in stats.items():
        fields = text.rsplit(")", 1)[-1].split()  # the name in parentheses may hold spaces
        parents[child] = int(fields[1])
        times[child] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        kids = [c for c, p in parents.items() if p == parent and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return sum(times.get(p, 0.0) for p in tree) if pid in times else None


# ---- the peer's virtualenv ----------------------------------------------------------------


def peer_setup_commands(venv: Path = PEER_VENV) -> list[list[str]]:
    """The steps that build the peer's venv: torch first, pinned to the local CPU build, so
    that installing transformers cannot pull a CUDA torch; then transformers' serving extra."""
    pip = str(venv / "bin" / "pip")
    return [["python3", "-m", "venv", str(venv)],
            [pip, "install", f"torch=={TORCH_VERSION}"],
            [pip, "install", f"transformers[serving]=={TRANSFORMERS_VERSION}"]]


def setup_peer_venv(venv: Path = PEER_VENV) -> None:
    """Runs `peer_setup_commands`, echoing each; skipped when the venv already has the CLI."""
    if (venv / "bin" / "transformers").exists():
        print(f"{venv} already has transformers; delete it to rebuild")
        return
    for cmd in peer_setup_commands(venv):
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
