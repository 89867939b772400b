"""kvserve's C++ CPU ops (kernels/cpu/*.cpp): building, loading and the Python
entry points the model and the CPU attention backend call.

The source is compiled with torch's extension tooling (a C++ compiler and ninja) into a cache
folder keyed by the source, the torch version and the CPU, so a rebuilt torch or another machine
never loads a stale or foreign library. `make setup` builds it (`python -m kernels.cpu_ops`);
an engine that finds no build compiles it once on first use. Where the compiler is missing or
the build fails, `load()` logs a WARNING and returns None, and every caller keeps its plain torch
path: the ops are a speed-up, never a requirement. `KVSERVE_CPU_OPS=0` turns them off.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("kvserve")
SOURCE_DIR = Path(__file__).parent / "cpu"
SOURCES = [SOURCE_DIR / name for name in ("kvserve_cpu_ops.cpp", "attention.cpp",
                                          "attention_avx512.cpp", "varlen_attention.cpp",
                                          "elementwise.cpp", "qgemm.cpp", "decoder_layer.cpp",
                                          "sampling.cpp", "decode_team.cpp",
                                          "decode_team_rows.cpp", "decode_logits.cpp")]
ENV_SWITCH = "KVSERVE_CPU_OPS"
# -march=native: the library is built on the machine that runs it (the cache key holds the
# CPU's flags). OpenMP lets `#pragma omp simd` vectorise the float reductions.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]

_state: dict[str, Any] = {"tried": False, "ops": None, "why": ""}


def cache_dir() -> Path:
    """Where builds live: $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve or ~/.cache/kvserve."""
    base = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve")
    return Path(base) / "cpu_ops"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def build_key() -> str:
    """Source, compiler flags, torch version and CPU flags, hashed."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    for part in (" ".join(CFLAGS), torch.__version__, _cpu_flags(), sys.version):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def enabled() -> bool:
    """False when KVSERVE_CPU_OPS=0 (or off/false) turns the ops off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


def build(verbose: bool = False) -> Path:
    """Compiles the library if this key has none yet; returns its path (raises on failure)."""
    from torch.utils import cpp_extension

    name = f"kvserve_cpu_ops_{build_key()}"
    folder = cache_dir() / name
    library = folder / f"{name}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH; install g++)")
    _put_ninja_on_path()
    folder.mkdir(parents=True, exist_ok=True)
    # torch's tooling marks a build with a `lock` file and waits, forever, while one exists: a
    # build killed midway (Ctrl-C on a first `kvserve serve`) left every later start hanging.
    # An OS lock, which dies with its process, serialises kvserve's builds of this key
    # instead; whoever holds it knows any `lock` file is left over, and removes it.
    with open(folder / "kvserve.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another process building this key: wait for it
        if library.exists():
            return library
        leftover = folder / "lock"
        if leftover.exists():
            logger.warning("Removing %s, left by a build of kvserve's CPU ops that was "
                           "interrupted", leftover)
            leftover.unlink()
        started = time.perf_counter()
        logger.info("Building kvserve's CPU ops into %s (once per torch version and CPU)",
                    folder)
        cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(folder),
                           is_python_module=False, verbose=verbose)
        logger.info("Built kvserve's CPU ops in %.1f s", time.perf_counter() - started)
    return library


def _put_ninja_on_path() -> None:
    """torch's tooling runs `ninja` from PATH: add the pip package's binary (a venv used without
    activation has it only there)."""
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def load() -> Any | None:
    """`torch.ops.kvserve_cpu` once loaded (building it if needed), or None with the reason
    logged once: turned off, no compiler, or a failed build."""
    if _state["tried"]:
        return _state["ops"]
    _state["tried"] = True
    if not enabled():
        _state["why"] = f"{ENV_SWITCH}=0"
        logger.info("kvserve's CPU ops are off (%s): plain torch ops on CPU", _state["why"])
        return None
    try:
        library = build()
        if not hasattr(torch.ops, "kvserve_cpu") or not hasattr(torch.ops.kvserve_cpu,
                                                                  "rms_norm"):
            torch.ops.load_library(str(library))
        _state["ops"] = torch.ops.kvserve_cpu
    except Exception as exc:  # a missing compiler, headers or ninja: fall back, say why
        _state["why"] = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        logger.warning("kvserve's CPU ops are unavailable (%s); CPU attention and the decoder "
                       "layer's elementwise work use plain torch ops (slower)", _state["why"])
    return _state["ops"]


def loaded() -> Any | None:
    """The ops if `load()` already succeeded, else None (never builds)."""
    return _state["ops"]


def reset() -> None:
    """Forgets the last `load()` outcome (tests switch the ops on and off)."""
    _state.update(tried=False, ops=None, why="")


def main() -> None:
    """`python -m kernels.cpu_ops`: build now (setup runs this), print where, or why not."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(build(verbose="-v" in sys.argv))
    except Exception as exc:
        print(f"kvserve's CPU ops were not built ({exc}); kvserve will run on plain torch ops",
              file=sys.stderr)


if __name__ == "__main__":
    main()
