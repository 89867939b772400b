"""What this CPU can do, for `--dtype auto`: bfloat16 where oneDNN runs bf16 matmuls natively.

oneDNN has native bf16 matrix instructions on x86 CPUs with AVX512-BF16 (`avx512_bf16`, Zen 4,
Cooper Lake and later) or AMX (`amx_bf16`, Sapphire Rapids and later). Elsewhere it emulates
bf16 with float32 arithmetic plus conversions, which measured 3.9x slower than float32 at 64
sequences on an AVX2 machine (README, "dtype on CPU"), so `auto` stays float32 there.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import torch

CPUINFO_PATH = Path("/proc/cpuinfo")
# /proc/cpuinfo flags that give oneDNN native bf16 matmuls, in the order they are named.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def parse_cpu_flags(cpuinfo_text: str) -> frozenset[str]:
    """The `flags` of the first processor in /proc/cpuinfo's text (x86 spelling)."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.lru_cache(maxsize=1)
def read_cpu_flags(path: Path = CPUINFO_PATH) -> frozenset[str]:
    """This machine's CPU flags; empty where there is no /proc/cpuinfo (not Linux)."""
    try:
        return parse_cpu_flags(path.read_text(errors="replace"))
    except OSError:
        return frozenset()


def native_bf16_flags(flags: Iterable[str]) -> list[str]:
    """The flags in `flags` that give native bf16 matmuls (empty: none)."""
    present = set(flags)
    return [flag for flag in NATIVE_BF16_FLAGS if flag in present]


def auto_cpu_dtype(flags: Iterable[str] | None = None) -> tuple[torch.dtype, str]:
    """The dtype `--dtype auto` gives on CPU and why, from `flags` (default: this CPU's).

    bfloat16 when a native bf16 flag is present and torch has oneDNN; float32 otherwise.
    """
    flags = read_cpu_flags() if flags is None else frozenset(flags)
    native = native_bf16_flags(flags)
    if not native:
        return torch.float32, ("this CPU lacks avx512_bf16 and amx_bf16, so oneDNN would "
                               "emulate bf16 matmuls (slower than float32)")
    if not torch.backends.mkldnn.is_available():
        return torch.float32, (f"this CPU has {', '.join(native)} but this torch build lacks "
                               "oneDNN, which runs bf16 matmuls natively")
    return torch.bfloat16, (f"this CPU has {', '.join(native)}: oneDNN runs bf16 matmuls "
                            "natively, at half the weight bytes of float32")
