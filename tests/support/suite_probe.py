"""Benchmarks for the suite's process isolation test (tests/loadtest/test_benchmark_suite.py):
each reports the process it ran in."""

from __future__ import annotations

import os
from typing import Any

from loadtest.benchmarks.common import SuiteContext


class Probe:
    """Reports its process id."""

    NAME = "Probe bench"
    COMMAND = "python -m tests.support.suite_probe"

    @staticmethod
    def run(ctx: SuiteContext) -> dict[str, Any]:
        return {"target": "-", "met": True, "summary": f"pid {os.getpid()}"}

    @staticmethod
    def render(result: dict[str, Any]) -> str:
        return result["summary"]


class SameModule(Probe):
    NAME = "Same module bench"
