"""What this CPU can do: the dtype `--dtype auto` picks, which weight dtypes oneDNN's packed
linear takes, and which ISA kvserve's C++ vector layer (kernels/cpu/vec) runs.

`--dtype auto`: bfloat16 where oneDNN runs bf16 matmuls natively. oneDNN has native bf16 matrix instructions on x86 CPUs with AVX512-BF16 (`avx512_bf16`, Zen 4,
Cooper Lake and later) or AMX (`amx_bf16`, Sapphire Rapids and later). Elsewhere it emulates
bf16 with float32 arithmetic plus conversions, which measured 3.9x slower than float32 at 64
sequences on an AVX2 machine (README, "dtype on CPU"), so `auto` stays float32 there.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Iterable
from pathlib import Path

import torch

CPUINFO_PATH = Path("/proc/cpuinfo")
# /proc/cpuinfo flags that give oneDNN native bf16 matmuls, in the order they are named.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")

# The flag sets with which oneDNN's packed linear takes 16-bit weights, any one sufficing: the
# CPUs torch's own check accepts (mkldnn_check_low_precision; its error names these flags).
# An AVX2-only CPU has none of them, and torch then raises on packing bf16 weights (issue 49).
ONEDNN_16BIT_LINEAR_FLAGS: dict[torch.dtype, tuple[frozenset[str], ...]] = {
    torch.bfloat16: (frozenset({"avx512bw", "avx512vl", "avx512dq"}),
                     frozenset({"avx_ne_convert"})),
    torch.float16: (frozenset({"avx512_fp16"}), frozenset({"avx_ne_convert"})),
}

# kvserve's vector layer ISAs on x86, widest first, with the flags each body is built on.
VECTOR_ISA_FLAGS = (("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),
                    ("avx2", frozenset({"avx2", "fma", "f16c"})))
# platform.machine() of 64-bit ARM (Linux, macOS), where the NEON body runs: NEON is part of
# AArch64, so no flag needs checking.
ARM64_MACHINES = ("aarch64", "arm64")
# Extras the vector layer's bodies use where present (VNNI dot products, bf16 dot products and
# conversions), in the order they are listed.
VECTOR_ISA_EXTRAS = ("avx512_vnni", "avx512_bf16", "avx_vnni")


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


def onednn_linear_supports(dtype: torch.dtype, flags: Iterable[str] | None = None) -> bool:
    """Whether oneDNN's packed linear (torch.ops.mkldnn._reorder_linear_weight) takes weights
    of `dtype` on this CPU, or on one with `flags`.

    float32 packs on any CPU torch's oneDNN runs on; bfloat16 needs avx512bw+avx512vl+avx512dq
    or avx_ne_convert, float16 avx512_fp16 or avx_ne_convert. Without `flags` torch's own check
    answers (the one the op makes: it also honours ONEDNN_MAX_CPU_ISA and knows ARM's bf16),
    and this CPU's flags only where this torch does not expose it.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    needs = ONEDNN_16BIT_LINEAR_FLAGS.get(dtype)
    if needs is None:
        return False
    if flags is None:
        name = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 \
            else "_is_mkldnn_fp16_supported"
        if hasattr(torch.ops.mkldnn, name):
            return bool(getattr(torch.ops.mkldnn, name)())
        flags = read_cpu_flags()
    present = frozenset(flags)
    return any(need <= present for need in needs)


def vector_isa(flags: Iterable[str] | None = None, machine: str | None = None) -> str:
    """The ISA of kvserve's C++ vector layer on this CPU, or on one with `flags` and
    `machine` (platform.machine()): "avx512", "avx2", "neon" or "none" (the scalar body).

    The default flags come through read_cpu_flags, which the test session replaces with an
    empty set (tests/conftest.py): pass the flags where a test needs the real CPU's ISA.
    """
    machine = platform.machine() if machine is None else machine
    if machine.lower() in ARM64_MACHINES:
        return "neon"
    present = read_cpu_flags() if flags is None else frozenset(flags)
    for isa, needs in VECTOR_ISA_FLAGS:
        if needs <= present:
            return isa
    return "none"


def vector_isa_features(flags: Iterable[str] | None = None) -> list[str]:
    """The extras in VECTOR_ISA_EXTRAS that this CPU (or `flags`) has, in that order."""
    present = read_cpu_flags() if flags is None else frozenset(flags)
    return [flag for flag in VECTOR_ISA_EXTRAS if flag in present]
