"""kvserve's C++ CPU ops build for every CPU it supports (issue 49), and a failed or impossible
build is reported once, precisely, and not retried by every process.

The per-target checks compile each source to an object file (no link, nothing loaded) with the
target's compiler: x86-64-v3 (AVX2), x86-64-v4 (AVX-512 with VNNI and BF16) and aarch64 (NEON
with the dot product, through aarch64-linux-gnu-g++, which `make setup` installs)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from torch.utils import cpp_extension

from kernels import cpu_ops, cpu_targets

# Preprocessor checks that the target's flags reached the compiler.
TARGET_MACROS = {
    "x86-64-v3": "defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) "
                 "&& !defined(__AVX512F__)",
    "x86-64-v4": "defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) "
                 "&& defined(__AVX512VNNI__) && defined(__AVX512BF16__)",
    "aarch64": "defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)",
}


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private cache, the default target and no remembered load()."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    for name in (cpu_ops.ENV_SWITCH, cpu_ops.MARCH_ENV, cpu_ops.EXTRA_FLAGS_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_ops, "_state", {"tried": False, "ops": None, "why": ""})
    return tmp_path


@pytest.fixture
def supported(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`fresh`, on a CPU the ops support whatever this machine is."""
    monkeypatch.setattr(cpu_ops, "unsupported_reason", lambda: "")
    return fresh


def _report(target: str, results: list[cpu_targets.Compiled]) -> str:
    failed = [r for r in results if not r.ok]
    lines = [f"{len(failed)} of {len(results)} sources do not compile for {target}:"]
    lines += [f"  {r.source.relative_to(cpu_ops.SOURCE_DIR)}: "
              + cpu_targets.first_errors(r.stderr).replace("\n", "\n    ") for r in failed]
    return "\n".join(lines) + f"\n\nfirst failure's compiler output:\n{failed[0].stderr[:6000]}"


@pytest.mark.slow
@pytest.mark.parametrize("target", list(cpu_targets.TARGETS))
def test_every_source_compiles_for(target: str, tmp_path: Path) -> None:
    """Each kernels/cpu source compiles (-O1, no link) for the target."""
    results = cpu_targets.compile_objects(target, tmp_path)
    assert len(results) == len(cpu_ops.SOURCES) > 0
    if not all(r.ok for r in results):
        pytest.fail(_report(target, results), pytrace=False)


@pytest.mark.parametrize("target", list(cpu_targets.TARGETS))
def test_the_check_compiles_for_the_target_and_reports_errors(target: str,
                                                              tmp_path: Path) -> None:
    """The machinery on two tiny sources: one compiles only where the target's instruction set
    macros are defined, one is broken and its error comes back."""
    good, broken = tmp_path / "good.cpp", tmp_path / "broken.cpp"
    good.write_text(f"#if !({TARGET_MACROS[target]})\n#error wrong target\n#endif\n"
                    "int twice(int x) { return 2 * x; }\n")
    broken.write_text("int f() { return not_declared_anywhere; }\n")
    results = cpu_targets.compile_objects(target, tmp_path / "obj", sources=[good, broken],
                                           pch=False)
    assert [r.source for r in results] == [good, broken]
    assert results[0].ok, results[0].stderr
    assert not results[1].ok and "not_declared_anywhere" in cpu_targets.first_errors(
        results[1].stderr)


def test_every_source_is_found_and_hashed_recursively(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """A source in a subfolder is built, and a header in a subfolder is part of the key."""
    (tmp_path / "vec").mkdir()
    for name in ("b.cpp", "a.cpp", "vec/c.cpp", "vec/isa.h", "notes.txt"):
        (tmp_path / name).write_text("// " + name)
    assert cpu_ops.find_sources(tmp_path) == [tmp_path / n for n in ("a.cpp", "b.cpp",
                                                                     "vec/c.cpp")]
    monkeypatch.setattr(cpu_ops, "SOURCE_DIR", tmp_path)
    monkeypatch.setattr(cpu_ops, "SOURCES", cpu_ops.find_sources(tmp_path))
    before = cpu_ops.build_key()
    (tmp_path / "vec/isa.h").write_text("// changed")
    assert cpu_ops.build_key() != before


def test_the_march_override_replaces_native_and_is_in_the_key(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """KVSERVE_CPU_MARCH (verbatim) and KVSERVE_CPU_EXTRA_FLAGS reach the compiler, are logged,
    and key a build of their own."""
    native_key = cpu_ops.build_key()
    monkeypatch.setenv(cpu_ops.MARCH_ENV, "x86-64-v3")
    monkeypatch.setenv(cpu_ops.EXTRA_FLAGS_ENV, " -mno-fma  -DKVSERVE_X=1 ")
    assert cpu_ops.target_flags() == ["-march=x86-64-v3", "-mno-fma", "-DKVSERVE_X=1"]
    assert cpu_ops.build_key() != native_key
    seen: list[list[str]] = []

    def fake_load(**kwargs: Any) -> None:
        seen.append(kwargs["extra_cflags"])
        (Path(kwargs["build_directory"]) / f"{kwargs['name']}.so").touch()

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        cpu_ops.build()
    assert seen == [cpu_ops.CFLAGS + ["-march=x86-64-v3", "-mno-fma", "-DKVSERVE_X=1"]]
    assert "-march=x86-64-v3" in caplog.text and cpu_ops.MARCH_ENV in caplog.text


def test_a_failed_build_names_its_sources_and_is_not_retried(
        supported: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A real build of two broken sources: both are named with their first error, the failure
    is remembered, a new process (reset()) does not compile again, and `python -m
    kernels.cpu_ops` retries and exits non-zero."""
    sources = [supported / "broken_one.cpp", supported / "broken_two.cpp"]
    sources[0].write_text("int f() { return first_missing_name; }\n")
    sources[1].write_text("int g() { return second_missing_name; }\n")
    monkeypatch.setattr(cpu_ops, "SOURCES", sources)
    calls: list[str] = []
    real_load = cpp_extension.load

    def counting_load(**kwargs: Any) -> Any:
        calls.append(kwargs["name"])
        return real_load(**kwargs)

    monkeypatch.setattr(cpp_extension, "load", counting_load)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert cpu_ops.load() is None
    assert len(calls) == 1 and len(caplog.records) == 1
    first = caplog.records[0].getMessage()
    for name in ("broken_one.cpp", "first_missing_name", "broken_two.cpp",
                 "second_missing_name", "-march=", "python -m kernels.cpu_ops"):
        assert name in first, first
    memo = cpu_ops.cache_dir() / f"kvserve_cpu_ops_{cpu_ops.build_key()}" / cpu_ops.MEMO
    assert memo.exists()

    cpu_ops.reset()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert cpu_ops.load() is None
    assert len(calls) == 1 and len(caplog.records) == 1  # no compile this time
    again = caplog.records[0].getMessage()
    assert "not rebuilt" in again and "first_missing_name" in again
    assert "python -m kernels.cpu_ops" in again

    assert cpu_ops.main([]) == 1 and len(calls) == 2  # setup retries, and fails the setup
    assert memo.exists()


def test_an_unsupported_cpu_warns_once_and_never_builds(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """x86 without AVX2 or F16C: one WARNING naming them, no build, and setup carries on."""
    monkeypatch.setattr(cpu_ops, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset("fpu sse sse2 avx fma".split()))

    def no_build(**kwargs: Any) -> None:
        raise AssertionError("built on an unsupported CPU")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    with caplog.at_level(logging.DEBUG, logger="kvserve"):
        assert cpu_ops.load() is None
        assert cpu_ops.load() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "lacks avx2, f16c " in warnings[0] and "several times slower" in warnings[0]
    assert cpu_ops.main([]) == 0
    assert not (fresh / "cache").exists()


def test_a_missing_compiler_is_one_warning_naming_it(
        supported: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """No compiler: one WARNING naming it and the cost, nothing remembered (installing g++
    fixes it), and setup fails."""
    monkeypatch.setenv("CXX", "kvserve-no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert cpu_ops.load() is None
    assert len(caplog.records) == 1
    assert "kvserve-no-such-compiler" in caplog.text and "several times slower" in caplog.text
    assert not (supported / "cache").exists()
    assert cpu_ops.main([]) == 1


def test_ninja_output_is_read_per_failed_step() -> None:
    """ninja's FAILED lines (with and without 1.12's [code=N]) give the output, the source
    after -c, and the first error lines; a link failure has no source."""
    output = "\n".join([
        "[1/3] c++ -c /src/ok.cpp -o ok.o",
        "FAILED: [code=1] a.o ",
        "c++ -MMD -MF a.o.d -isystem '/x y' -c /src/a.cpp -o a.o",
        "/src/a.cpp: In function 'int f()':",
        "/src/a.cpp:1:18: error: 'x' was not declared in this scope",
        "FAILED: lib.so ",
        "c++ a.o -shared -o lib.so",
        "/usr/bin/ld: undefined reference to `g'",
        "collect2: error: ld returned 1 exit status",
        "ninja: build stopped: subcommand failed.",
    ])
    failures = cpu_targets.parse_ninja(output)
    assert [(f.output, f.source) for f in failures] == [("a.o", "/src/a.cpp"), ("lib.so", "")]
    assert failures[0].errors == "/src/a.cpp:1:18: error: 'x' was not declared in this scope"
    assert "ld returned 1" in failures[1].errors
