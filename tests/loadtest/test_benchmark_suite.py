"""The benchmark suite's runner and page: every section states its target and verdict, and a
benchmark that crashes is reported as not measured while the others still run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from loadtest.benchmarks import __main__ as suite
from loadtest.benchmarks.common import DOCS, SuiteContext


class Passing:
    NAME = "Passing bench"
    COMMAND = "python -m x.passing"

    @staticmethod
    def run(ctx: SuiteContext) -> dict[str, Any]:
        return {"target": "< 2% waste", "met": True, "summary": "1.5% waste"}

    @staticmethod
    def render(result: dict[str, Any]) -> str:
        return "| a | b |\n|---|---|\n| 1 | 2 |"


class Missing(Passing):
    NAME = "Missing bench"

    @staticmethod
    def run(ctx: SuiteContext) -> dict[str, Any]:
        return {"target": ">= 10x", "met": False, "summary": "2.6x"}


class Crashing(Passing):
    NAME = "Crashing bench"

    @staticmethod
    def run(ctx: SuiteContext) -> dict[str, Any]:
        raise RuntimeError("server did not start")


def row_cells(text: str, name: str) -> list[str]:
    """The cells of the summary-table row whose first cell starts with `name`."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row {name!r} in:\n{text}")


def test_page_lists_every_verdict_and_survives_a_crash(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    benches = {"a": Passing, "b": Crashing, "c": Missing}
    monkeypatch.setattr(suite, "REGISTRY", [(k, "unused", k) for k in benches])
    monkeypatch.setattr(suite, "load", lambda module, attr: benches[attr])
    md, js = tmp_path / "b.md", tmp_path / "b.json"
    assert suite.main(["--threads", "1", "--in-process", "--markdown", str(md), "--json",
                       str(js)]) == 0
    text = md.read_text()
    assert row_cells(text, "1. Passing bench")[1:] == ["< 2% waste", "1.5% waste", "met"]
    assert row_cells(text, "2. Crashing bench")[2:] == ["failed to run", "not measured"]
    assert row_cells(text, "3. Missing bench")[1:] == [">= 10x", "2.6x", "missed"]
    assert "## 2. Crashing bench" in text and "server did not start" in text
    assert "## 3. Missing bench" in text and "python -m x.passing" in text
    assert "torch threads 1" in text
    saved = orjson.loads(js.read_bytes())
    assert [r["met"] for r in saved["results"]] == [True, None, False]


def test_registry_names_every_benchmark_of_the_issue() -> None:
    names = [suite.load(m, a).NAME.lower() for _, m, a in suite.REGISTRY]
    for word in ("offline", "batch-1", "serving", "waste", "prefix", "chunked", "overhead",
                 "fp8", "gpu", "structured output", "llama.cpp", "parallel"):
        assert any(word in n for n in names), word
    for _, m, a in suite.REGISTRY:
        bench = suite.load(m, a)
        assert callable(bench.run) and callable(bench.render) and bench.COMMAND
    assert len({k for k, _, _ in suite.REGISTRY}) == len(suite.REGISTRY) == 13


class Skipping(Passing):
    NAME = "Skipping bench"

    @staticmethod
    def run(ctx: SuiteContext) -> dict[str, Any]:
        return {"target": "GPU", "met": None, "summary": "skipped: no CUDA GPU", "skipped": True}


def broken(bench: Any) -> Any:
    """`bench` under the same name, failing if run: shows that a result was kept, not rerun."""
    class Broken(bench):  # type: ignore[misc, valid-type]
        @staticmethod
        def run(ctx: SuiteContext) -> dict[str, Any]:
            raise AssertionError(f"{bench.NAME} was run again")
    return Broken


def run_suite(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, benches: dict[str, Any],
              *flags: str) -> tuple[str, dict[str, Any]]:
    """main() over fake benchmarks into tmp_path; the page and the JSON it wrote."""
    monkeypatch.setattr(suite, "REGISTRY", [(k, "unused", k) for k in ("a", "b", "c")])
    monkeypatch.setattr(suite, "load", lambda module, attr: benches[attr])
    md, js = tmp_path / "b.md", tmp_path / "b.json"
    assert suite.main(["--threads", "1", "--in-process", "--markdown", str(md), "--json", str(js),
                       *flags]) == 0
    return md.read_text(), orjson.loads(js.read_bytes())


def test_only_keeps_the_other_sections(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    run_suite(monkeypatch, tmp_path, {"a": Passing, "b": Crashing, "c": Missing})
    saved = orjson.loads((tmp_path / "b.json").read_bytes())
    saved["results"][0]["date"] = "2000-01-01 00:00 UTC"  # as if measured by an earlier run
    saved["results"][0]["machine"] = "Old CPU (avx2)"  # ... on another machine
    (tmp_path / "b.json").write_bytes(orjson.dumps(saved))
    text, data = run_suite(monkeypatch, tmp_path,
                           {"a": broken(Passing), "b": Crashing, "c": broken(Missing)},
                           "--only", "b")
    assert [r["key"] for r in data["results"]] == ["a", "b", "c"]
    assert [r["met"] for r in data["results"]] == [True, None, False]  # a and c kept
    assert row_cells(text, "1. Passing bench")[1:] == ["< 2% waste", "1.5% waste", "met"]
    assert row_cells(text, "3. Missing bench")[1:] == [">= 10x", "2.6x", "missed"]
    assert "was run again" not in text
    assert "measured 2000-01-01 00:00 UTC on Old CPU (avx2)" in text
    assert data["results"][1]["machine"] == data["env"]["cpu"] != "Old CPU (avx2)"
    assert "keep the figures of earlier runs" in text


def test_a_skip_never_hides_a_measurement(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    text, _ = run_suite(monkeypatch, tmp_path, {"a": Skipping, "b": Passing, "c": Passing})
    assert row_cells(text, "1. Skipping bench")[2:] == ["skipped: no CUDA GPU", "skipped"]
    _, data = run_suite(monkeypatch, tmp_path, {"a": Missing, "b": Passing, "c": Passing},
                        "--only", "a")
    text, data = run_suite(monkeypatch, tmp_path, {"a": Skipping, "b": Passing, "c": Passing},
                           "--only", "a")
    assert data["results"][0]["summary"] == "2.6x" and "skipped" not in text


def test_render_only_rewrites_the_page_from_the_json(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    first, _ = run_suite(monkeypatch, tmp_path, {"a": Passing, "b": Crashing, "c": Missing})
    (tmp_path / "b.md").write_text("stale")
    again, _ = run_suite(monkeypatch, tmp_path,
                         {"a": broken(Passing), "b": broken(Crashing), "c": broken(Missing)},
                         "--render-only")
    assert again == first


def test_the_committed_page_is_its_json_rendered() -> None:
    """docs/benchmarks.md holds exactly what docs/benchmarks.json renders to, so every figure
    on the page comes from a measurement the suite stored."""
    env, results = suite.load_previous(DOCS / "benchmarks.json")
    assert env is not None and set(results) == {k for k, _, _ in suite.REGISTRY}
    assert suite.render(env, results) == (DOCS / "benchmarks.md").read_text()


def test_each_module_runs_in_a_fresh_process(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    """By default the benchmarks of one module share a spawned process of their own, never
    the suite's (an engine's threads there were slowed by what earlier benchmarks left)."""
    monkeypatch.setattr(suite, "REGISTRY", [("a", "tests.support.suite_probe", "Probe"),
                                            ("b", "tests.support.suite_probe", "SameModule"),
                                            ("c", "tests.support.suite_probe_other",
                                             "OtherModule")])
    md, js = tmp_path / "b.md", tmp_path / "b.json"
    assert suite.main(["--threads", "1", "--markdown", str(md), "--json", str(js)]) == 0
    pids = [r["summary"] for r in orjson.loads(js.read_bytes())["results"]]
    assert pids[0] == pids[1] != pids[2]
    assert f"pid {os.getpid()}" not in pids
