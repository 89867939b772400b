"""The torch-free kernel harness (tests/kernels/harness/harness.cpp) built once per ISA: the
vector layer's ops and the int8-dot linear bodies on every ISA must give the scalar build's bits.

x86 builds run where /proc/cpuinfo has their flags (else they are only compiled); aarch64 ones
run under qemu-aarch64 (Debian's qemu-user, with g++-aarch64-linux-gnu to build them), against
an aarch64 scalar build: a float's conversion to int32 out of range (x86: 0x80000000, aarch64:
saturated) and the NaNs that arithmetic returns differ by architecture, not by ISA.
"""

from __future__ import annotations

import os
import platform
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "kernels" / "harness" / "harness.cpp"
FLAGS = ["-O2", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-DKVSERVE_NO_TORCH",
         f"-I{ROOT / 'kernels' / 'cpu'}"]
V3 = ["avx2", "fma", "f16c", "bmi2"]
V4 = V3 + ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"]
# name: (architecture, compiler flags, /proc/cpuinfo flags to run it, reference build)
BUILDS = {
    "scalar": ("x86_64", ["-DKVSERVE_VEC_SCALAR"], [], None),
    "avx2": ("x86_64", ["-march=x86-64-v3"], V3, "scalar"),
    "avx2+avxvnni": ("x86_64", ["-march=x86-64-v3", "-mavxvnni"], V3 + ["avx_vnni"], "scalar"),
    "avx512": ("x86_64", ["-march=x86-64-v4"], V4, "scalar"),
    "avx512+vnni+bf16": ("x86_64", ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],
                         V4 + ["avx512_vnni", "avx512_bf16"], "scalar"),
    "aarch64-scalar": ("aarch64", ["-DKVSERVE_VEC_SCALAR"], [], None),
    "neon+dotprod": ("aarch64", ["-march=armv8.2-a+dotprod"], ["asimddp"], "aarch64-scalar"),
    "neon": ("aarch64", ["-march=armv8-a"], [], "aarch64-scalar"),
}
Output = dict[str, tuple[str, str]]  # label: (kind, hex)
MISSING = "missing tools: "  # a build's result that fails its tests (other strings skip them)


def _host_flags() -> set[str]:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return flags


def _build_and_run(name: str, folder: Path) -> Output | str:
    """The build's output, or why it cannot run here (a reason to skip)."""
    arch, flags, needs, _ = BUILDS[name]
    native = platform.machine() == arch
    compiler = "g++" if native else f"{arch}-linux-gnu-g++"
    prefix: list[str] = []
    if not native and arch == "aarch64":
        missing = [t for t in (compiler, "qemu-aarch64") if shutil.which(t) is None]
        if missing:  # never skipped: CI installs them
            return (f"{MISSING}{', '.join(missing)} not found: install the Debian packages "
                    "g++-aarch64-linux-gnu and qemu-user to build and run aarch64 kernels")
        prefix = ["qemu-aarch64", "-L", f"/usr/{arch}-linux-gnu"]
    if shutil.which(compiler) is None:
        return f"no {compiler} to build {arch} code"
    binary = folder / name
    built = subprocess.run([compiler, *flags, *FLAGS, str(SOURCE), "-o", str(binary)],
                           capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        raise RuntimeError(f"{name} does not build:\n{built.stderr[-4000:]}")
    if not native and not prefix:
        return f"{arch} code does not run on this {platform.machine()} host"
    lacking = sorted(set(needs) - _host_flags()) if native else []
    if lacking:
        return f"built, not run: this CPU lacks {', '.join(lacking)}"
    run = subprocess.run([*prefix, str(binary)], capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"{name} exited with {run.returncode}:\n{run.stderr[-4000:]}")
    out: Output = {}
    for line in run.stdout.splitlines():
        if not line.startswith("#"):
            label, kind, values = line.split(" ", 2)
            out[label] = (kind, values)
    return out


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Output | str]:
    """Every build's output, built and run in parallel (aarch64 first: qemu runs longest)."""
    folder = tmp_path_factory.mktemp("harness")
    names = sorted(BUILDS, key=lambda n: BUILDS[n][0] != "aarch64")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda n: _build_and_run(n, folder), names))
    return dict(zip(names, results, strict=True))


def _lanes(kind: str, values: str) -> list[str]:
    return [values[i:i + 2] for i in range(0, len(values), 2)] if kind in ("u8", "i8") \
        else values.split()


def _is_nan(kind: str, h: str) -> bool:
    v = int(h, 16)
    return (kind == "f32" and (v & 0x7FFFFFFF) > 0x7F800000) or \
        (kind == "f16" and (v & 0x7FFF) > 0x7C00)


def _show(kind: str, h: str) -> str:
    v = int(h, 16)
    if kind in ("f32", "bf16", "f16"):
        value = struct.unpack("<e", struct.pack("<H", v))[0] if kind == "f16" else \
            struct.unpack("<f", struct.pack("<I", v << 16 if kind == "bf16" else v))[0]
        return f"{h} ({value!r})"
    if kind in ("i32", "i8"):
        bits = 4 * len(h)
        return f"{h} ({v - (1 << bits) if v >> (bits - 1) else v})"
    return h


def _mismatches(ref: Output, got: Output, labels: list[str]) -> list[str]:
    """Labels whose values differ, each with its differing lanes and its case's inputs. A NaN
    matches any NaN in floats and float16: which NaN arithmetic returns (IEEE leaves it open),
    or a float16 store keeps of a NaN's payload (F16C and NEON keep it, c10 on x86 does not)
    is no part of the layer's contract; bfloat16 stores give 0x7FC0 by contract."""
    report = []
    for label in labels:
        kind, r = ref[label]
        g = got[label][1]
        if r == g:
            continue
        rl, gl = _lanes(kind, r), _lanes(kind, g)
        if len(rl) != len(gl):
            report.append(f"{label}: {len(gl)} values, the scalar build {len(rl)}")
            continue
        bad = [i for i, (a, b) in enumerate(zip(rl, gl, strict=True))
               if a != b and not (_is_nan(kind, a) and _is_nan(kind, b))]
        if not bad:
            continue
        case = label.rsplit("/", 1)[0] + "/in."
        shown = bad[:4]
        inputs = [f"    {k} {' '.join(_lanes(*v)[i] for i in shown if i < len(_lanes(*v)))}"
                  for k, v in ref.items() if k.startswith(case)]
        report.append(f"{label}: {len(bad)} of {len(rl)} lanes differ\n" + "\n".join(
            f"    lane {i}: scalar {_show(kind, rl[i])}, got {_show(kind, gl[i])}"
            for i in shown) + ("\n  inputs at those lanes:\n" + "\n".join(inputs)
                               if inputs else ""))
    return report


def _output(outputs: dict[str, Output | str], name: str) -> Output:
    result = outputs[name]
    if isinstance(result, str):
        (pytest.fail if result.startswith(MISSING) else pytest.skip)(f"{name}: {result}")
    return result


@pytest.mark.parametrize("name", [n for n, b in BUILDS.items() if b[3] is not None])
def test_isa_gives_the_scalar_bits(outputs: dict[str, Output | str], name: str) -> None:
    ref, got = _output(outputs, BUILDS[name][3] or ""), _output(outputs, name)
    assert list(got) == list(ref), "the builds printed different checks"
    bad = _mismatches(ref, got, list(ref))
    if bad:
        pytest.fail(f"{name}: {len(bad)} checks differ from the scalar build's, the first:\n"
                    + "\n".join(bad[:6]), pytrace=False)


def test_scalar_builds_agree_across_architectures(outputs: dict[str, Output | str]) -> None:
    """The quantized x and the linears' outputs are the same on x86 and aarch64 (x holds no NaN
    nor inf there: those convert to int32 differently)."""
    ref, got = _output(outputs, "scalar"), _output(outputs, "aarch64-scalar")
    labels = [k for k in ref if k.startswith(("quant/", "linear/")) and "/special" not in k]
    bad = _mismatches(ref, got, labels)
    if bad:
        pytest.fail(f"{len(bad)} checks differ between x86 and aarch64, the first:\n"
                    + "\n".join(bad[:6]), pytrace=False)
