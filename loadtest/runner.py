"""Sends a dataset's requests to a server on an arrival schedule and records every one.

Arrivals follow `loadtest.arrivals` (Poisson, gamma bursts, or all at once), optionally capped
by `max_concurrency` in flight: a request due while the cap is reached waits for a free slot,
and later arrivals wait behind it, as in vLLM's benchmark. A prompt with a pinned send time
(the long-prompt dataset) is sent at that time whatever the cap. Sending stops after
`num_prompts` requests or `duration_s` seconds, whichever comes first; requests already sent
finish, each bounded by `request_timeout_s`. The server's /metrics is scraped meanwhile.
`run_fixed_concurrency` is the same driver with C requests in flight and nothing else.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from tqdm import tqdm

from loadtest.arrivals import arrival_gaps, send_times
from loadtest.datasets import Prompt, Tokenizer
from loadtest.records import RequestRecord, fail
from loadtest.scrape import MetricsScraper, server_summary
from loadtest.sse_client import StreamRequest, request_headers, stream_request
from loadtest.ws_client import WSClient

TRANSPORTS = ("sse", "ws")


@dataclass
class LoadConfig:
    """How requests are sent (the arrival and transport flags of `python -m loadtest run`)."""

    url: str = "http://127.0.0.1:8000"
    transport: str = "sse"
    api_key: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None
    seed: int = 0
    request_timeout_s: float = 600.0
    scrape_interval_s: float = 1.0
    include_usage: bool = True
    progress: bool = True
    scrape_metrics: bool = True


@dataclass
class LoadRun:
    """Every sent request's record, in send order, and the run's timing and server samples."""

    records: list[RequestRecord]
    duration_s: float
    not_sent: int
    server_metrics: list[dict[str, Any]] = field(default_factory=list)
    server_summary: dict[str, Any] | None = None


class Transport(Protocol):
    """Sends one streaming request and returns its record (never raises for server faults)."""

    async def stream(self, req: StreamRequest, include_usage: bool = True,
                     timeout_s: float = 600.0) -> RequestRecord: ...


class SSETransport:
    """HTTP + SSE over a pooled aiohttp session."""

    def __init__(self, base_url: str, api_key: str | None, session: aiohttp.ClientSession):
        self.base_url, self.api_key, self.session = base_url, api_key, session

    async def stream(self, req: StreamRequest, include_usage: bool = True,
                     timeout_s: float = 600.0) -> RequestRecord:
        """One request over its own HTTP stream."""
        return await stream_request(self.session, self.base_url, req, include_usage, timeout_s,
                                    self.api_key)


def schedule(send_at: Sequence[float | None], cfg: LoadConfig
             ) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """(arrival-process sends, pinned sends): each a list of (seconds from start, index);
    `send_at` holds each request's pinned send time, or None to follow the arrivals."""
    free = [i for i, at in enumerate(send_at) if at is None]
    times = send_times(arrival_gaps(cfg.request_rate, cfg.burstiness, len(free), cfg.seed))
    pinned = [(float(at), i) for i, at in enumerate(send_at) if at is not None]
    return list(zip(times, free, strict=True)), pinned


class _Run:
    """State of one run: the transport, the cap, the records and the progress bar."""

    def __init__(self, cfg: LoadConfig, transport: Transport, requests: Sequence[StreamRequest],
                 prompts: Sequence[Prompt] | None):
        self.cfg, self.transport, self.requests, self.prompts = cfg, transport, requests, prompts
        self.records: dict[int, RequestRecord] = {}
        self.cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.tasks: list[asyncio.Task[None]] = []
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + (math.inf if cfg.duration_s is None else cfg.duration_s)
        self.bar = tqdm(total=len(requests), disable=not cfg.progress, unit="req",
                        dynamic_ncols=True, leave=False)
        self.failed = 0

    async def _one(self, index: int, capped: bool) -> None:
        sent = time.perf_counter()
        try:
            record = await self.transport.stream(self.requests[index], self.cfg.include_usage,
                                                 self.cfg.request_timeout_s)
        except Exception as exc:  # a transport bug must not end the run: count it
            record = RequestRecord()
            fail(record, "client_error", f"{type(exc).__name__}: {exc}")
        finally:
            if capped and self.cap is not None:
                self.cap.release()
        record.start_s = sent - self.t0
        if record.prompt_tokens is None and self.prompts is not None:  # the tokenizer's count
            record.prompt_tokens = self.prompts[index].prompt_len
        self.records[index] = record
        self.failed += not record.ok
        self.bar.update(1)
        self.bar.set_postfix(failed=self.failed, refresh=False)

    async def _wait_until(self, at_s: float) -> bool:
        """Sleeps until `at_s` from the start; False when that is past the deadline."""
        due = self.t0 + at_s
        if due >= self.deadline:
            return False
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        return True

    async def _acquire(self) -> bool:
        """A slot under the cap, or False when the deadline passes while waiting."""
        if self.cap is None:
            return True
        remaining = self.deadline - time.perf_counter()
        try:
            await asyncio.wait_for(self.cap.acquire(), None if math.isinf(remaining)
                                   else max(remaining, 0.0))
        except asyncio.TimeoutError:
            return False
        return True

    async def send_arrivals(self, sends: list[tuple[float, int]]) -> None:
        """Sends the arrival-process requests on time, under the cap, until the deadline."""
        for at_s, index in sends:
            if not await self._wait_until(at_s) or not await self._acquire():
                return
            if time.perf_counter() >= self.deadline:
                if self.cap is not None:
                    self.cap.release()
                return
            self.tasks.append(asyncio.create_task(self._one(index, capped=True)))

    async def send_pinned(self, at_s: float, index: int) -> None:
        """Sends one pinned request at its time (whatever the cap) unless past the deadline."""
        if await self._wait_until(at_s):
            await self._one(index, capped=False)


async def _drive(cfg: LoadConfig, transport: Transport, requests: Sequence[StreamRequest],
                 prompts: Sequence[Prompt] | None) -> tuple[_Run, float]:
    """Sends every request on its schedule and waits for all; returns the run and its wall
    time. Without prompts, nothing is pinned and no prompt length is filled in."""
    run = _Run(cfg, transport, requests, prompts)
    send_at = [p.send_at_s for p in prompts] if prompts is not None else [None] * len(requests)
    sends, pinned = schedule(send_at, cfg)
    pinned_tasks = [asyncio.create_task(run.send_pinned(at, i)) for at, i in pinned]
    try:
        await run.send_arrivals(sends)
        await asyncio.gather(*run.tasks, *pinned_tasks)
    finally:
        run.bar.close()
    return run, time.perf_counter() - run.t0


async def run_load(cfg: LoadConfig, prompts: Sequence[Prompt] | None,
                   requests: Sequence[StreamRequest]) -> LoadRun:
    """Runs the load; returns the records in send order with the scraped server metrics.
    `prompts` (one per request, or None) pin send times and give prompt lengths."""
    if cfg.transport not in TRANSPORTS:
        raise ValueError(f"--transport must be one of {', '.join(TRANSPORTS)}, got "
                         f"{cfg.transport!r}")
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector) as session, \
            aiohttp.ClientSession() as scrape_session:
        scraper = MetricsScraper(scrape_session, cfg.url, cfg.scrape_interval_s, cfg.api_key)
        if cfg.scrape_metrics:
            scraper.start(time.perf_counter())
        if cfg.transport == "ws":
            async with WSClient(cfg.url, cfg.api_key) as ws:
                run, duration = await _drive(cfg, ws, requests, prompts)
        else:
            run, duration = await _drive(cfg, SSETransport(cfg.url, cfg.api_key, session),
                                         requests, prompts)
        samples = await scraper.stop() if cfg.scrape_metrics else []
    records = sorted(run.records.values(), key=lambda r: r.start_s)
    return LoadRun(records, duration, len(requests) - len(records), samples,
                   server_summary(samples))


async def run_fixed_concurrency(base_url: str, requests: Sequence[StreamRequest],
                                concurrency: int, time_limit_s: float = math.inf,
                                include_usage: bool = True, request_timeout_s: float = 600.0
                                ) -> LoadRun:
    """`requests` over SSE with `concurrency` in flight, sent as slots free up, no scraping.
    No request starts after `time_limit_s`; those already running finish (bounded by
    `request_timeout_s`), so the run ends within roughly the sum of the two."""
    cfg = LoadConfig(url=base_url, max_concurrency=concurrency, duration_s=time_limit_s,
                     request_timeout_s=request_timeout_s, include_usage=include_usage,
                     progress=False, scrape_metrics=False)
    return await run_load(cfg, None, requests)


def count_output_tokens(run: LoadRun, tokenizer: Tokenizer) -> None:
    """Output tokens the server did not report, counted by tokenizing the received text
    (until then a record counts one token a content chunk)."""
    for record in run.records:
        if not record.usage_reported and record.ok and record.text:
            record.output_tokens = len(tokenizer.encode(record.text))


async def first_model(url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The first model id the server lists at /v1/models."""
    async with aiohttp.ClientSession() as session, session.get(
            url.rstrip("/") + "/v1/models", headers=request_headers(api_key),
            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise ConnectionError(f"GET /v1/models answered {resp.status}: "
                                  f"{(await resp.text())[:300]}")
        data = (await resp.json()).get("data") or []
    if not data:
        raise ConnectionError("the server lists no models at /v1/models")
    return str(data[0]["id"])
