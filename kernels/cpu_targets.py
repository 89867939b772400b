"""Compiling kvserve's C++ CPU sources (kernels/cpu) per target CPU, and reading failed builds.

Two users: tests/kernels/test_cpu_build.py compiles every source to an object file (no link,
nothing loaded) for each CPU kvserve supports, so an x86-only intrinsic or an AVX-512-only
path shows up on an AVX-512 x86 host; and kernels/cpu_ops.py, whose failed build is re-run
with ninja's keep-going flag to name every source that failed and its first compiler errors.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import subprocess
import sysconfig
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# Named targets: (architecture, compiler flags). x86-64-v3 is AVX2+FMA+F16C (Haswell, Zen 1 and
# later); x86-64-v4 is AVX-512 F/BW/DQ/VL, here with VNNI and BF16 (Cooper Lake, Sapphire
# Rapids, Zen 4); aarch64 is ARMv8.2-A with the dot product and half precision extensions
# (Neoverse N1/Graviton2, Ampere Altra, Apple M1 and later).
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "x86-64-v3": ("x86_64", ("-march=x86-64-v3",)),
    "x86-64-v4": ("x86_64", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16")),
    "aarch64": ("aarch64", ("-march=armv8.2-a+dotprod+fp16",)),
}
# The Debian package of each architecture's cross compiler (`make setup` installs the other
# architecture's).
CROSS_PACKAGES = {"x86_64": "g++-x86-64-linux-gnu", "aarch64": "g++-aarch64-linux-gnu"}
# The torch headers kvserve's sources start with. Parsing them is ~6 of a source's ~9 CPU
# seconds at -O1, so the per-target check parses them once per target into gcc's precompiled
# header (used where the flags match, else ignored). Each source still includes them itself,
# so the only cost in fidelity: a source that forgets one of them compiles here, and fails in
# the real build (`make setup`, test_cpu_ops.py) instead.
PCH_HEADERS = ("ATen/ATen.h", "ATen/Parallel.h", "torch/library.h")
PCH_NAME = "kvserve_torch_headers.h"
_FAILED = re.compile(r"^FAILED: (?:\[code=\d+\] )?(\S+)")  # ninja 1.12+ adds [code=N]
_STEP = re.compile(r"^\[\d+/\d+\] ")
# Error lines, and gcc's pointer from an intrinsic's error in its header to the source line.
_ERROR = re.compile(r"\berror\b|note: called from here", re.IGNORECASE)


@dataclass(frozen=True)
class Compiled:
    """One source's compile for one target: ok, or the compiler's stderr saying why not."""

    source: Path
    ok: bool
    stderr: str
    seconds: float


@dataclass(frozen=True)
class Failure:
    """One failed step of a ninja build: its output (an object file, or the library when the
    link failed), the source it compiled ('' for a link) and the first error lines."""

    output: str
    source: str
    errors: str


def machine() -> str:
    """This machine's architecture: 'x86_64', 'aarch64', or platform.machine()'s own word."""
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def cxx() -> str:
    """The host C++ compiler, as torch's extension tooling picks it: $CXX, else `c++`."""
    return os.environ.get("CXX", "c++")


def target_compiler(target: str) -> str:
    """The compiler for a named target: the host's for its own architecture, else Debian's
    cross compiler (aarch64-linux-gnu-g++ on x86-64)."""
    arch = TARGETS[target][0]
    return cxx() if arch == machine() else f"{arch}-linux-gnu-g++"


def torch_cflags() -> list[str]:
    """The defines, include folders and flags torch's extension tooling compiles a CPU source
    with, in its order (its -std=c++20 precedes kvserve's flags, which may override it)."""
    from torch.utils.cpp_extension import include_paths

    folders = [*include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    flags = ["-DTORCH_EXTENSION_NAME=kvserve_cpu_ops_check", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    for folder in folders:
        flags += ["-isystem", folder]
    return flags + ["-fPIC", "-std=c++20"]


def compile_objects(target: str, out_dir: Path | str, sources: Sequence[Path] | None = None,
                    opt: str = "-O1", jobs: int = 2, pch: bool = True) -> list[Compiled]:
    """Compiles each source (default: kvserve's, cpu_ops.SOURCES) to an object file in
    `out_dir` for a target named in TARGETS, with kvserve's flags but `opt` for -O3, `jobs`
    at a time; one Compiled per source, in order. `pch` parses the torch headers once, into
    a precompiled header (see PCH_HEADERS). Raises FileNotFoundError when the target's
    compiler is not on PATH."""
    from kernels import cpu_ops  # cpu_ops imports this module

    files = list(cpu_ops.SOURCES if sources is None else sources)
    compiler = target_compiler(target)
    if shutil.which(compiler) is None:
        package = CROSS_PACKAGES.get(TARGETS[target][0], "g++")
        raise FileNotFoundError(f"{compiler} is not on PATH (Debian: apt-get install {package};"
                                " `make setup` installs it)")
    kvserve_flags = [flag for flag in cpu_ops.CFLAGS if not flag.startswith("-O")]
    flags = [f"-I{cpu_ops.SOURCE_DIR}", *torch_cflags(), *kvserve_flags, opt,
             *TARGETS[target][1]]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if pch:
        flags += _precompile(compiler, flags, out)

    def one(item: tuple[int, Path]) -> Compiled:
        index, source = item
        started = time.perf_counter()
        # Numbered objects: sources in different subfolders may share a name.
        command = [compiler, *flags, "-c", str(source), "-o", str(out / f"{index:03d}_"
                                                                  f"{source.stem}.o")]
        done = subprocess.run(command, capture_output=True, text=True)
        return Compiled(source, done.returncode == 0, done.stderr, time.perf_counter() - started)

    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return list(pool.map(one, enumerate(files)))
    finally:
        (out / f"{PCH_NAME}.gch").unlink(missing_ok=True)  # ~400 MB


def _precompile(compiler: str, flags: list[str], folder: Path) -> list[str]:
    """The flags that make each source start from a precompiled header of PCH_HEADERS, built
    with `flags`; none where it does not build (each source then parses them itself)."""
    header = folder / PCH_NAME
    header.write_text("".join(f"#include <{name}>\n" for name in PCH_HEADERS))
    done = subprocess.run([compiler, *flags, "-x", "c++-header", str(header), "-o",
                           f"{header}.gch"], capture_output=True)
    return ["-include", str(header)] if done.returncode == 0 else []


def first_errors(text: str, limit: int = 3) -> str:
    """The first `limit` lines of compiler output that say error (or where an intrinsic that
    failed was called from), else its last lines (a compiler killed for memory says no
    'error')."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR.search(line)]
    return "\n".join((errors or lines[-limit:])[:limit])


def parse_ninja(output: str) -> list[Failure]:
    """The failed steps in ninja's output: after each `FAILED: <output>` line come the command
    and then what it printed, until the next step, failure or ninja's summary."""
    failures: list[Failure] = []
    current: str | None = None
    lines: list[str] = []
    for line in output.splitlines() + ["ninja: end"]:
        match = _FAILED.match(line)
        if match or _STEP.match(line) or line.startswith("ninja: "):
            if current is not None:
                failures.append(_failure(current, lines))
            current, lines = (match.group(1) if match else None), []
        elif current is not None:
            lines.append(line)
    return failures


def _failure(output: str, lines: list[str]) -> Failure:
    words = shlex.split(lines[0]) if lines else []
    source = words[words.index("-c") + 1] if "-c" in words[:-1] else ""
    return Failure(output, source, first_errors("\n".join(lines[1:])))


def ninja_failures(build_dir: Path, timeout: float = 1800) -> list[Failure]:
    """Runs ninja again in a failed build's folder, keeping going past failures (-k 0), so
    every source that fails is named, not only the first; what already built is kept."""
    try:
        done = subprocess.run(["ninja", "-k", "0"], cwd=build_dir, capture_output=True,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_ninja(done.stdout + done.stderr)


def put_ninja_on_path() -> None:
    """torch's tooling runs `ninja` from PATH: add the pip package's binary (a venv used without
    activation has it only there)."""
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def native_arch(compiler: str) -> str:
    """What -march=native means to `compiler` on this machine (gcc's name, such as znver4), or
    '' where it will not say (clang)."""
    try:
        done = subprocess.run([compiler, "-march=native", "-Q", "--help=target"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    match = re.search(r"^\s*-march=\s+(\S+)", done.stdout, re.MULTILINE)
    return match.group(1) if match and match.group(1) != "native" else ""
