"""The benchmark suite's runner and page: every section states its target and verdict, and a
benchmark that crashes is reported as not measured while the others still run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from loadtest.benchmarks import __main__ as suite
from loadtest.benchmarks.common import SuiteContext


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
    assert suite.main(["--threads", "1", "--markdown", str(md), "--json", str(js)]) == 0
    text = md.read_text()
    assert row_cells(text, "1. Passing bench")[1:] == ["< 2% waste", "1.5% waste", "met"]
    assert row_cells(text, "2. Crashing bench")[2:] == ["failed to run", "not measured"]
    assert row_cells(text, "3. Missing bench")[1:] == [">= 10x", "2.6x", "missed"]
    assert "## 2. Crashing bench" in text and "server did not start" in text
    assert "## 3. Missing bench" in text and "python -m x.passing" in text
    assert "torch threads 1" in text
    saved = orjson.loads(js.read_bytes())
    assert [r["met"] for r in saved["results"]] == [True, None, False]


def test_registry_names_the_seven_benchmarks_of_the_issue() -> None:
    names = [suite.load(m, a).NAME.lower() for _, m, a in suite.REGISTRY]
    for word in ("offline", "batch-1", "serving", "waste", "prefix", "chunked", "overhead"):
        assert any(word in n for n in names), word
    for _, m, a in suite.REGISTRY:
        bench = suite.load(m, a)
        assert callable(bench.run) and callable(bench.render) and bench.COMMAND
