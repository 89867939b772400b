"""What every benchmark of the suite shares: its context, the shape of its result, markdown
tables, seeded token-id workloads and the standalone command line.

Each benchmark (a module, or a class for two that share one measurement) exposes
  NAME: str                                   the section title in docs/benchmarks.md
  COMMAND: str                                how to run it alone (python -m ...)
  def run(ctx: SuiteContext) -> dict          measures; returns a JSON-able result
  def render(result: dict) -> str             markdown: tables, the target line, notes
The result holds at least "target" (the goal in words), "met" (True, False, or None when it
could not be measured) and "summary" (one line with the figure that decides "met"); a
benchmark that could not run here (no GPU) adds "skipped": True.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable, Sequence
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
        """Where a plot called `name` goes (the folder is created)."""
        self.plot_dir.mkdir(parents=True, exist_ok=True)
        return self.plot_dir / name


def verdict(met: bool | None, skipped: bool = False) -> str:
    """The word a target line ends with."""
    if skipped:
        return "skipped"
    return {True: "met", False: "missed", None: "not measured"}[met]


def target_line(target: str, met: bool | None, measured: str) -> str:
    """"**Target**: <goal>. **Measured**: <figure>. **met/missed**"."""
    return f"**Target:** {target}. **Measured:** {measured}. **Verdict: {verdict(met)}.**"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


# ---- markdown tables ----------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown pipe table; floats get 3 significant digits, None prints as '-'."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
              for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


# ---- seeded workloads ---------------------------------------------------------------------


def spread_lengths(num: int, lo: int, hi: int, seed: int) -> list[int]:
    """`num` lengths evenly spaced over [lo, hi] (both ends included), shuffled by `seed`.

    Even spacing rather than uniform draws keeps the mean at (lo + hi) / 2 for any seed.
    """
    if num == 1:
        return [(lo + hi) // 2]
    lengths = [lo + round(i * (hi - lo) / (num - 1)) for i in range(num)]
    random.Random(seed).shuffle(lengths)
    return lengths


def random_prompts(lengths: Sequence[int], vocab_size: int, excluded_ids: set[int],
                   seed: int) -> list[list[int]]:
    """Random token ids of the given lengths, never drawing an id from `excluded_ids`."""
    allowed = [i for i in range(vocab_size) if i not in excluded_ids]
    rng = random.Random(seed)
    return [rng.choices(allowed, k=n) for n in lengths]


# ---- one benchmark alone ------------------------------------------------------------------


def run_alone(name: str, run: Callable[[SuiteContext], dict[str, Any]],
              render: Callable[[dict[str, Any]], str], argv: Sequence[str] | None = None,
              model_flag: bool = False) -> None:
    """A benchmark module's own CLI: [--quick] [--threads N] [--json PATH] (and [--model M]
    when the benchmark takes one, passed as ctx.extra["model"]); prints markdown. Nothing
    goes to docs/: the suite (`python -m loadtest.benchmarks --only KEY`) writes there."""
    parser = argparse.ArgumentParser(description=name)
    parser.add_argument("--quick", action="store_true", help="small workload, a smoke run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", dest="json_path", help="also write the result here")
    if model_flag:
        parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2")
    ns = parser.parse_args(argv)
    extra = {"model": ns.model} if model_flag and ns.model else {}
    result = run(SuiteContext(threads=ns.threads, quick=ns.quick, extra=extra))
    print(render(result))
    if ns.json_path:
        Path(ns.json_path).write_text(json.dumps(result, indent=2, default=str))
