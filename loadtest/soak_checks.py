"""What a soak run samples and judges: the tally of outcomes, RSS and /metrics samples, the
pass/fail of each property (listed in `loadtest.soak`) and the printed report."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.scrape import parse_metrics


@dataclass
class Tally:
    """What the load did: outcomes by kind, and the failures worth reporting."""

    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def problem(self, kind: str, detail: str) -> None:
        """Counts one problem of `kind` and keeps its detail (the first 50)."""
        self.outcomes[kind] += 1
        if len(self.problems) < 50:
            self.problems.append(f"{kind}: {detail[:300]}")


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def sample(session: aiohttp.ClientSession, url: str, pid: int, t0: float
                 ) -> dict[str, Any]:
    """One sample: seconds since start, RSS and the /metrics gauges and counters."""
    async with session.get(url + "/metrics") as resp:
        page = parse_metrics(await resp.text())
    return {"t_s": round(time.monotonic() - t0, 1), "rss_bytes": rss_bytes(pid), **page}


async def sampler(url: str, pid: int, t0: float, interval_s: float, stop: asyncio.Event,
                  tally: Tally) -> None:
    """Samples until `stop` is set."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            try:
                tally.samples.append(await sample(session, url, pid, t0))
            except (aiohttp.ClientError, ValueError) as exc:
                tally.problem("scrape_failed", repr(exc))
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass


async def wait_idle(url: str, pid: int, t0: float, timeout_s: float) -> dict[str, Any]:
    """The first sample with nothing running or waiting and no KV in use (or the last)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            last = await sample(session, url, pid, t0)
            idle = (last["running"], last["waiting"], last["kv_cache_usage"]) == (0, 0, 0)
            if idle or time.monotonic() > deadline:
                return last
            await asyncio.sleep(0.2)


def check(tally: Tally, final: dict[str, Any], args: argparse.Namespace
          ) -> tuple[dict[str, Any], dict[str, bool]]:
    """The figures and the pass/fail of each property."""
    warmup_s = min(60.0, args.minutes * 60 / 3)
    warm = next((s for s in tally.samples if s["t_s"] >= warmup_s and s["rss_bytes"]), None)
    warm_rss = warm["rss_bytes"] if warm else None
    end_rss = final["rss_bytes"]
    growth = (end_rss - warm_rss) / warm_rss if warm_rss and end_rss else None
    out = tally.outcomes
    figures = {
        "minutes": args.minutes, "warmup_s": warmup_s, "rss_after_warmup_mib": _mib(warm_rss),
        "rss_end_mib": _mib(end_rss),
        "rss_max_mib": _mib(max((s["rss_bytes"] or 0 for s in tally.samples), default=0)),
        "rss_growth_pct": None if growth is None else round(100 * growth, 2),
        "final_running": final["running"], "final_waiting": final["waiting"],
        "final_kv_cache_usage": final["kv_cache_usage"], "preemptions": final["preemptions"],
        **dict(sorted(out.items())),
    }
    passed = {
        "rss_growth": growth is not None and growth < args.max_rss_growth,
        "no_leaked_kv": final["kv_cache_usage"] == 0,
        "no_5xx": out["5xx"] == 0,
        "no_stuck": out["stuck"] == 0 and final["running"] == 0 and final["waiting"] == 0,
        "good_ok": out["good_failed"] == 0 and out["ok_sse"] + out["ok_ws"] > 0,
        "bad_refused": out["bad_not_refused"] == 0 and out["bad_refused"] > 0,
    }
    return figures, passed


def _mib(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


def report(figures: dict[str, Any], passed: dict[str, bool], problems: list[str]) -> None:
    """Prints the figures and the verdicts."""
    width = max(len(k) for k in figures)
    print("\nsoak figures")
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value}")
    print("\nproperties")
    for key, ok in passed.items():
        print(f"  {key:<14} {'PASS' if ok else 'FAIL'}")
    for line in problems[:20]:
        print(f"  problem: {line}")
