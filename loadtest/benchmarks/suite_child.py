"""The suite's benchmarks in a fresh process (`python -m loadtest.benchmarks` without
--in-process): what the spawned child runs. It lives outside the suite's `__main__`, which
multiprocessing does not import into a spawned child."""

from __future__ import annotations

from typing import Any

from loadtest.benchmarks.common import SuiteContext


def run_group(entries: list[tuple[str, str, str | None]], ctx: SuiteContext,
              env: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The suite's run_group, in this (child) process."""
    from loadtest.benchmarks import __main__ as suite

    return suite.run_group(entries, ctx, env)
