"""The GPU check's findings, shared by its sections (kernels, end to end) and its runner."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch


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


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def release(device: torch.device) -> None:
    """Frees what the last section left behind, so the next one gets the device's memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
