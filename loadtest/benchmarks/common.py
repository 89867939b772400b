"""What every benchmark of the suite shares: its context and the shape of its result.

Each benchmark module in this package exposes
  NAME: str                                   the section title in docs/benchmarks.md
  COMMAND: str                                how to run it alone (python -m ...)
  def run(ctx: SuiteContext) -> dict          measures; returns a JSON-able result
  def render(result: dict) -> str             markdown: tables, the target line, notes
The result holds at least "target" (the goal in words), "met" (True, False, or None when it
could not be measured) and "summary" (one line with the figure that decides "met").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PLOTS = DOCS / "benchmarks"


@dataclass
class SuiteContext:
    """Settings shared by every benchmark in one suite run."""

    threads: int = 2              # torch threads for engines and servers
    quick: bool = False           # smaller workloads, for a smoke run (not for the docs)
    plot_dir: Path = PLOTS        # where PNGs go (docs/benchmarks/)
    log_dir: Path = ROOT / "results"
    extra: dict[str, Any] = field(default_factory=dict)

    def apply_threads(self) -> None:
        """Sets torch's thread count for in-process engines."""
        torch.set_num_threads(self.threads)
        os.environ["OMP_NUM_THREADS"] = str(self.threads)

    def plot_path(self, name: str) -> Path:
        self.plot_dir.mkdir(parents=True, exist_ok=True)
        return self.plot_dir / name


def verdict(met: bool | None) -> str:
    """The word a target line ends with."""
    return {True: "met", False: "missed", None: "not measured"}[met]


def target_line(target: str, met: bool | None, measured: str) -> str:
    """"**Target**: <goal>. **Measured**: <figure>. **met/missed**"."""
    return f"**Target:** {target}. **Measured:** {measured}. **Verdict: {verdict(met)}.**"
