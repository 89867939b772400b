"""kvserve's C++ CPU ops (kernels/cpu/**/*.cpp): building, loading and the Python entry points
the model and the CPU attention backend call.

The sources are compiled with torch's extension tooling (a C++ compiler and ninja) into a
cache folder keyed by the sources and headers, the flags, the torch version and the CPU, so a
rebuilt torch or another machine never loads a stale or foreign library. `make setup` builds it
(`python -m kernels.cpu_ops`, which fails the setup when the build fails); an engine that finds
no build compiles it once on first use. The ops need x86-64 with AVX2+FMA+F16C, or aarch64.
Where the CPU lacks those, the compiler is missing or the build fails, `load()` logs one
WARNING and returns None, and every caller keeps its plain torch path. A failed build is
remembered per key (FAILED.json in its folder), so later processes do not compile again;
`python -m kernels.cpu_ops` retries. `KVSERVE_CPU_OPS=0` turns the ops off.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kernels import cpu_targets
from kernels.cpu_targets import cxx, machine

logger = logging.getLogger("kvserve")
SOURCE_DIR = Path(__file__).parent / "cpu"


def find_sources(root: Path = SOURCE_DIR) -> list[Path]:
    """Every C++ source under `root`, subfolders included, sorted: a new file is built with no
    list to edit."""
    return sorted(root.rglob("*.cpp"))


SOURCES = find_sources()
ENV_SWITCH = "KVSERVE_CPU_OPS"
MARCH_ENV = "KVSERVE_CPU_MARCH"  # e.g. x86-64-v3: the AVX2 build on an AVX-512 host
EXTRA_FLAGS_ENV = "KVSERVE_CPU_EXTRA_FLAGS"  # space-separated, after the -march flag
# OpenMP lets `#pragma omp simd` vectorise the float reductions. The -march/-mcpu flag comes
# from target_flags().
CFLAGS = ["-O3", "-fopenmp", "-std=c++17"]
X86_NEEDS = ("avx2", "fma", "f16c")  # /proc/cpuinfo's spelling; aarch64 always has NEON
NEEDS = "kvserve's C++ CPU ops need x86-64 with AVX2+FMA+F16C or aarch64"
SLOWER = "decoding runs on plain torch ops, several times slower"
RETRY = "`python -m kernels.cpu_ops` retries the build"
MEMO = "FAILED.json"

_state: dict[str, Any] = {"tried": False, "ops": None, "why": ""}


class BuildError(RuntimeError):
    """The build failed: which sources on which target, with their first compiler errors.
    `remembered` holds when an earlier process's failure was read back, not a new build."""

    def __init__(self, message: str, remembered: str = "") -> None:
        super().__init__(message)
        self.remembered = remembered


class CompilerMissing(RuntimeError):
    """No C++ compiler on PATH (not remembered: installing one fixes it)."""


def cache_dir() -> Path:
    """Where builds live: $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve or ~/.cache/kvserve."""
    base = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve")
    return Path(base) / "cpu_ops"


def cpu_flags() -> frozenset[str]:
    """The first processor's flags in /proc/cpuinfo (x86 `flags`, aarch64 `Features`); empty
    where there are none."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def unsupported_reason() -> str:
    """Why this CPU cannot run the ops, or '' when it can."""
    arch = machine()
    if arch == "aarch64":
        return ""
    if arch != "x86_64":
        return f"this CPU is {arch}, not x86-64 or aarch64"
    missing = [flag for flag in X86_NEEDS if flag not in cpu_flags()]
    return f"this CPU lacks {', '.join(missing)} (/proc/cpuinfo flags)" if missing else ""


def target_flags() -> list[str]:
    """The target CPU flags: native (the library runs where it is built; the key holds the
    CPU's flags), or -march=$KVSERVE_CPU_MARCH verbatim; then $KVSERVE_CPU_EXTRA_FLAGS."""
    march = os.environ.get(MARCH_ENV, "").strip()
    if march:
        flags = [f"-march={march}"]
    else:  # gcc's aarch64 convention is -mcpu (architecture and tuning)
        flags = ["-mcpu=native" if machine() == "aarch64" else "-march=native"]
    return flags + os.environ.get(EXTRA_FLAGS_ENV, "").split()


def describe_target() -> str:
    """The target in words for messages: architecture and flags, with what native means."""
    flags = " ".join(target_flags())
    native = cpu_targets.native_arch(cxx()) if "-march=native" in flags else ""
    return f"{machine()} {flags}" + (f" ({native})" if native else "")


def _label(path: Path) -> str:
    try:
        return path.relative_to(SOURCE_DIR).as_posix()
    except ValueError:  # a source outside kernels/cpu (tests add one)
        return str(path)


def build_key() -> str:
    """Sources and headers (kernels/cpu recursively, with their paths), flags, compiler, torch
    version and CPU flags, hashed."""
    digest = hashlib.sha256()
    tree = {p for p in SOURCE_DIR.rglob("*") if p.suffix in (".cpp", ".h") and p.is_file()}
    for path in sorted(tree | set(SOURCES), key=_label):
        digest.update(_label(path).encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (" ".join(_label(p) for p in SOURCES), " ".join(CFLAGS + target_flags()), cxx(),
                 torch.__version__, machine(), " ".join(sorted(cpu_flags())), sys.version):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def enabled() -> bool:
    """False when KVSERVE_CPU_OPS=0 (or off/false) turns the ops off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


def build(verbose: bool = False, retry: bool = False) -> Path:
    """Compiles the library if this key has none yet; returns its path. Raises CompilerMissing,
    or BuildError for a failed build, which is remembered: later calls raise it again without
    compiling, unless `retry`."""
    name = f"kvserve_cpu_ops_{build_key()}"
    folder = cache_dir() / name
    library = folder / f"{name}.so"
    if library.exists():
        return library
    if not retry:
        _raise_remembered(folder)
    if shutil.which(cxx()) is None:
        raise CompilerMissing(f"no C++ compiler: {cxx()!r} is not on PATH (install g++)")
    cpu_targets.put_ninja_on_path()
    folder.mkdir(parents=True, exist_ok=True)
    # torch's tooling marks a build with a `lock` file and waits, forever, while one exists: a
    # build killed midway (Ctrl-C on a first `kvserve serve`) left every later start hanging.
    # An OS lock, which dies with its process, serialises kvserve's builds of this key
    # instead; whoever holds it knows any `lock` file is left over, and removes it.
    with open(folder / "kvserve.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another process building this key: wait for it
        if library.exists():
            return library
        if retry:
            (folder / MEMO).unlink(missing_ok=True)
        else:
            _raise_remembered(folder)  # the process we waited for failed: do not fail again
        leftover = folder / "lock"
        if leftover.exists():
            logger.warning("Removing %s, left by a build of kvserve's CPU ops that was "
                           "interrupted", leftover)
            leftover.unlink()
        _compile(name, folder, verbose)
    return library


def _compile(name: str, folder: Path, verbose: bool) -> None:
    from torch.utils import cpp_extension

    flags = target_flags()
    if os.environ.get(MARCH_ENV, "").strip() or os.environ.get(EXTRA_FLAGS_ENV, "").strip():
        logger.info("kvserve's CPU ops target %s, from %s/%s", " ".join(flags), MARCH_ENV,
                    EXTRA_FLAGS_ENV)
    started = time.perf_counter()
    logger.info("Building kvserve's CPU ops into %s (once per source, torch version and CPU)",
                folder)
    try:
        cpp_extension.load(name=name, sources=[str(p) for p in SOURCES],
                           extra_cflags=CFLAGS + flags, extra_ldflags=["-fopenmp"],
                           extra_include_paths=[str(SOURCE_DIR)],  # "vec/x.h" from subfolders
                           build_directory=str(folder), is_python_module=False, verbose=verbose)
    except Exception as exc:
        error = BuildError(_failure_message(folder, exc))
        _remember(folder, str(error))
        raise error from exc
    logger.info("Built kvserve's CPU ops in %.1f s", time.perf_counter() - started)


def _failure_message(folder: Path, exc: Exception) -> str:
    """Which sources failed on which target, with their first errors; torch's own message
    holds only ninja's first failure, so ninja runs again and keeps going."""
    target = describe_target()
    failures = cpu_targets.ninja_failures(folder) if (folder / "build.ninja").exists() else []
    if not failures:
        return f"the build for {target} failed: {cpu_targets.first_errors(str(exc))}"
    named = sorted(((_label(Path(f.source)) if f.source else f"linking {f.output}", f)
                    for f in failures), key=lambda pair: pair[0])
    lines = [f"{', '.join(name for name, _ in named)} failed to build for {target}:"]
    for name, failure in named:  # the compiler's lines name the source by its full path
        errors = failure.errors.replace(failure.source, name) if failure.source else failure.errors
        lines.append(f"  {name}: " + errors.replace("\n", "\n    "))
    return "\n".join(lines)


def _remember(folder: Path, message: str) -> None:
    memo = {"message": message, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "torch": torch.__version__, "target": " ".join(target_flags())}
    partial = folder / f"{MEMO}.partial"
    partial.write_text(json.dumps(memo, indent=1))
    partial.replace(folder / MEMO)  # whole or absent, for a process reading it meanwhile


def _raise_remembered(folder: Path) -> None:
    try:
        memo = json.loads((folder / MEMO).read_text())
    except (OSError, ValueError):  # none, or unreadable: build rather than guess
        return
    raise BuildError(str(memo.get("message", "?")), remembered=str(memo.get("when", "?")))


def _build_warning(exc: BuildError) -> str:
    if exc.remembered:
        return (f"kvserve's C++ CPU ops failed to build at {exc.remembered}, and are not "
                f"rebuilt for the same sources, flags, torch and CPU: {exc}\n{SLOWER}; {RETRY}")
    return (f"kvserve's C++ CPU ops failed to build: {exc}\n{SLOWER}; later processes will not "
            f"try again: {RETRY}")


def load() -> Any | None:
    """`torch.ops.kvserve_cpu` once loaded (building it if needed), or None with the reason
    logged once: turned off, an unsupported CPU, no compiler, or a failed build."""
    if _state["tried"]:
        return _state["ops"]
    _state["tried"] = True
    if not enabled():
        _state["why"] = f"{ENV_SWITCH}=0"
        logger.info("kvserve's CPU ops are off (%s): plain torch ops on CPU", _state["why"])
        return None
    _state["why"] = unsupported_reason()
    if _state["why"]:
        logger.warning("%s: %s; %s", _state["why"], NEEDS, SLOWER)
        return None
    try:
        library = build()
        if not hasattr(torch.ops, "kvserve_cpu") or not hasattr(torch.ops.kvserve_cpu,
                                                                  "rms_norm"):
            torch.ops.load_library(str(library))
        _state["ops"] = torch.ops.kvserve_cpu
    except BuildError as exc:
        _state["why"] = str(exc).splitlines()[0]
        logger.warning("%s", _build_warning(exc))
    except CompilerMissing as exc:
        _state["why"] = str(exc)
        logger.warning("%s: kvserve's C++ CPU ops cannot be built; %s", exc, SLOWER)
    except Exception as exc:  # missing headers or ninja, a library that will not load
        _state["why"] = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        logger.warning("kvserve's CPU ops are unavailable (%s); %s", _state["why"], SLOWER)
    return _state["ops"]


def loaded() -> Any | None:
    """The ops if `load()` already succeeded, else None (never builds)."""
    return _state["ops"]


def reset() -> None:
    """Forgets the last `load()` outcome (tests switch the ops on and off)."""
    _state.update(tried=False, ops=None, why="")


def main(argv: list[str] | None = None) -> int:
    """`python -m kernels.cpu_ops [-v]`: build now, retrying a remembered failure (setup runs
    this). Prints the library's path and returns 0; 1 when the build fails on a supported CPU;
    0 with a warning on an unsupported CPU or with the ops turned off."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = sys.argv[1:] if argv is None else argv
    if not enabled():
        print(f"kvserve's CPU ops are off ({ENV_SWITCH}=0): nothing to build", file=sys.stderr)
        return 0
    reason = unsupported_reason()
    if reason:
        print(f"{reason}: {NEEDS}; {SLOWER}", file=sys.stderr)
        return 0
    try:
        print(build(verbose="-v" in args, retry=True))
    except Exception as exc:
        print(f"kvserve's C++ CPU ops were not built: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
