"""The machine side of the benchmarks: CPU contention sampling, waiting for a quiet machine,
the rates a roofline rests on (matmul, memory bandwidth), and the description of the machine
and software every result carries."""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

QUIET_CORES = 0.25  # other processes busier than this make a timing suspect
GIB = 1024**3

# ---- contention: the machine may be shared, so every timing records who else ran ----------


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process), or None off Linux."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def other_cores(before: tuple[float, float], after: tuple[float, float], wall: float) -> float:
    """Mean number of cores kept busy by other processes between two `cpu_seconds()` reads."""
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / max(wall, 1e-9))


def wait_for_quiet(max_wait_s: float, threshold: float = QUIET_CORES,
                   window_s: float = 2.0) -> float:
    """Sleeps until other processes use under `threshold` cores over a window, or gives up
    after `max_wait_s`; returns the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait_s:
        before = cpu_seconds()
        time.sleep(window_s)
        after = cpu_seconds()
        if before is None or after is None or other_cores(before, after, window_s) < threshold:
            break
    return time.perf_counter() - start


def median_run(run: Callable[[], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """The run with the median tokens/s of `repeats` (llama-bench's -r 3 likewise repeats its
    runs: one second-long run moved by 10% between runs on a noisy VM), with every run's
    tokens/s in `runs_tokens_per_s`, lowest first."""
    runs = sorted((run() for _ in range(max(1, repeats))), key=lambda r: r["tokens_per_s"])
    return {**runs[len(runs) // 2], "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def timed(fn: Callable[[], dict[str, Any]], quiet_wait_s: float) -> dict[str, Any]:
    """Runs a measurement (after waiting for a quiet machine, if asked) and adds the cores
    other processes used meanwhile as `other_cpu_cores`."""
    waited = wait_for_quiet(quiet_wait_s) if quiet_wait_s > 0 else 0.0
    before, start = cpu_seconds(), time.perf_counter()
    result = fn()
    after, wall = cpu_seconds(), time.perf_counter() - start
    result["other_cpu_cores"] = (None if before is None or after is None
                                 else other_cores(before, after, wall))
    result["waited_for_quiet_s"] = waited
    return result


def other_cpu_values(node: Any) -> list[float]:
    """Every `other_cpu_cores` measured anywhere in a nested result."""
    if isinstance(node, dict):
        own = [node["other_cpu_cores"]] if node.get("other_cpu_cores") is not None else []
        return own + [v for child in node.values() for v in other_cpu_values(child)]
    return []


# ---- machine rates ------------------------------------------------------------------------


def best_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Best wall time of `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_gflops(m: int, k: int, n: int, repeats: int = 5) -> float:
    """float32 [m, k] @ [k, n] rate in GFLOP/s, best of `repeats`."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    seconds = best_seconds(lambda: torch.matmul(a, b), repeats)
    return 2 * m * k * n / seconds / 1e9


def matmul_rates(size: int, repeats: int = 5) -> dict[str, float | None]:
    """Square [size x size] matmul rates by arithmetic, in G ops/s: float32 and bfloat16
    (torch.matmul) and int8 x int8 -> int32 (`torch._int_mm`, oneDNN's VNNI kernels where the
    CPU has them); None where this torch lacks one."""
    rates: dict[str, float | None] = {"float32": matmul_gflops(size, size, size, repeats)}
    a = torch.randn(size, size).to(torch.bfloat16)
    rates["bfloat16"] = 2 * size**3 / best_seconds(lambda: a @ a, repeats) / 1e9
    q = torch.randint(-127, 128, (size, size), dtype=torch.int8)
    try:
        rates["int8"] = 2 * size**3 / best_seconds(lambda: torch._int_mm(q, q), repeats) / 1e9
    except (RuntimeError, AttributeError, NotImplementedError):
        rates["int8"] = None
    return rates


def read_bandwidth_gbs(num_bytes: int, repeats: int = 5) -> dict[str, float]:
    """Memory rates in GB/s over a float32 tensor of `num_bytes`: `sum` (reads it once) and
    `copy` (reads and writes it; counted as 2 x bytes)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    sum_s = best_seconds(lambda: src.sum(), repeats)
    copy_s = best_seconds(lambda: dst.copy_(src), repeats)
    return {"read_gbs": num_bytes / sum_s / 1e9, "copy_gbs": 2 * num_bytes / copy_s / 1e9}


# ---- description --------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, with the SIMD flags that matter here."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), "unknown")
    flags = next((set(ln.split(":", 1)[1].split()) for ln in info.splitlines()
                  if ln.startswith("flags")), set())
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                        "amx_int8") if f in flags]
    return f"{name} ({os.cpu_count()} logical CPUs; {', '.join(simd) or 'no AVX2'})"


def environment(threads: int, command: str) -> dict[str, Any]:
    """Date, machine, versions, torch threads and the command that produced a result."""
    import transformers

    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "command": command}
