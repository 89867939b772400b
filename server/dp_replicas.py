"""The child `kvserve serve` processes of `--data-parallel-size N` (server/data_parallel.py):
their command lines, start, readiness, death watch, stop and reaping, and the merge of their
/metrics pages into one.

Each child is the same `kvserve serve` command line with `--data-parallel-size 1` and its own
`--host 127.0.0.1 --port P --num-threads T` appended (argparse keeps the last value of a flag),
so every engine flag means in a child what it means in a one-process server.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from loadtest.serve_process import free_port

logger = logging.getLogger("kvserve")

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 1800.0  # loading a large model onto a GPU takes minutes
WATCH_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1


@dataclass
class Replica:
    """One child server."""

    index: int
    port: int
    proc: subprocess.Popen[bytes]
    signalled: bool = False  # SIGTERM sent once: a second would make it exit without draining

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT."""
        return f"http://127.0.0.1:{self.port}"


def threads_per_replica(num_threads: int | None, size: int) -> int:
    """--num-threads (or the machine's cores) divided among the replicas, at least 1 each."""
    total = num_threads or os.cpu_count() or 1
    return max(1, total // size)


def child_argv(argv: list[str], port: int, threads: int) -> list[str]:
    """The child's command line: the front's own flags, then the ones that must differ."""
    return [sys.executable, "-m", "server.cli", *argv, "--data-parallel-size", "1",
            "--host", "127.0.0.1", "--port", str(port), "--num-threads", str(threads)]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM if the front dies without reaping it (SIGKILL, OOM)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def start_replicas(argv: list[str], size: int, num_threads: int | None) -> list[Replica]:
    """Starts `size` children; their output goes to the front's stdout and stderr."""
    threads = threads_per_replica(num_threads, size)
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    replicas = []
    for index in range(size):
        port = free_port()
        # Its own session: a Ctrl-C in the terminal reaches the front alone, which then drains
        # the children with one SIGTERM (a second signal would make them exit at once).
        proc = subprocess.Popen(child_argv(argv, port, threads), env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)
        replicas.append(Replica(index, port, proc))
        logger.info("data parallel: replica %d is pid %d on port %d with %d thread(s)",
                    index, proc.pid, port, threads)
    return replicas


async def wait_ready(replicas: list[Replica], session: aiohttp.ClientSession,
                     timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Waits until every child answers /health 200; raises RuntimeError if one exits first or
    the timeout passes."""
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            if replica.proc.poll() is not None:
                raise RuntimeError(f"replica {replica.index} exited with code "
                                   f"{replica.proc.returncode} before it was ready")
            try:
                async with session.get(replica.url + "/health",
                                       timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        pending.remove(replica)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass  # not listening yet
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replica(s) {[r.index for r in pending]} not ready after "
                               f"{timeout_s:.0f} s")
        if pending:
            await asyncio.sleep(0.2)


def terminate_all(replicas: list[Replica]) -> None:
    """Sends SIGTERM (drain) once to every child still running."""
    for replica in replicas:
        if replica.proc.poll() is None and not replica.signalled:
            replica.signalled = True
            try:
                replica.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass


async def reap(replicas: list[Replica], grace_s: float) -> None:
    """Waits up to `grace_s` for the children to exit, then SIGKILLs and reaps the rest."""
    deadline = time.monotonic() + grace_s
    while any(r.proc.poll() is None for r in replicas) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for replica in replicas:
        if replica.proc.poll() is None:
            logger.warning("replica %d did not exit within %.0f s: killing it", replica.index,
                           grace_s)
            replica.proc.kill()
        replica.proc.wait()


# ---- /metrics ------------------------------------------------------------------------------


def _with_label(sample: str, label: str) -> str:
    """A Prometheus sample line with `label` (`name="value"`) added first."""
    brace, space = sample.find("{"), sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        close = sample.find("}", brace)
        sep = "," if close > brace + 1 else ""
        return f"{sample[:brace + 1]}{label}{sep}{sample[brace + 1:]}"
    return f"{sample[:space]}{{{label}}}{sample[space:]}"


def merge_metrics(pages: list[str | None]) -> str:
    """The children's /metrics pages as one: each family once (its HELP and TYPE lines from the
    first page that has it), every sample with a `replica="i"` label. A page that could not be
    read (None) is left out."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for index, page in enumerate(pages):
        if page is None:
            continue
        family = ""
        seen_header: set[str] = set()
        for line in page.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    samples.setdefault(family, [])
                    if family not in headers or family in seen_header:
                        headers.setdefault(family, []).append(line)
                        seen_header.add(family)
                continue
            samples.setdefault(family, []).append(_with_label(line, f'replica="{index}"'))
    out = []
    for family, lines in samples.items():
        out.extend(headers.get(family, []))
        out.extend(lines)
    return "\n".join(out) + "\n"


def front_metrics(in_flight: list[int], healthy: list[bool], routed: list[int],
                  affinity_hits: int) -> str:
    """The front's own figures, in Prometheus text format."""
    lines = ["# HELP kvserve_dp_replica_in_flight Requests the front has in flight on each "
             "replica.", "# TYPE kvserve_dp_replica_in_flight gauge"]
    lines += [f'kvserve_dp_replica_in_flight{{replica="{i}"}} {n}'
              for i, n in enumerate(in_flight)]
    lines += ["# HELP kvserve_dp_replica_healthy 1 while the replica's process runs.",
              "# TYPE kvserve_dp_replica_healthy gauge"]
    lines += [f'kvserve_dp_replica_healthy{{replica="{i}"}} {int(ok)}'
              for i, ok in enumerate(healthy)]
    lines += ["# HELP kvserve_dp_routed_requests_total Requests routed to each replica.",
              "# TYPE kvserve_dp_routed_requests_total counter"]
    lines += [f'kvserve_dp_routed_requests_total{{replica="{i}"}} {n}'
              for i, n in enumerate(routed)]
    lines += ["# HELP kvserve_dp_affinity_hits_total Requests sent to the replica that served "
              "their prompt prefix.", "# TYPE kvserve_dp_affinity_hits_total counter",
              f"kvserve_dp_affinity_hits_total {affinity_hits}"]
    return "\n".join(lines) + "\n"
