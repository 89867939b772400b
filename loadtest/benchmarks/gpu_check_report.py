"""The GPU check's findings, shared by its sections (kernels, end to end) and its runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Report:
    """Everything measured, and the summary rows printed last."""

    device: str
    sections: dict[str, Any] = field(default_factory=dict)
    summary: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, name: str, value: str, verdict: str = "") -> None:
        """One summary row."""
        self.summary.append((name, value, verdict))
        print(f"[gpu_check] {name}: {value} {verdict}", flush=True)
