"""A soak run: `python -m loadtest.soak [--minutes 10] [--model default] [--threads 1]`.

Starts `kvserve serve` (the embedded SmolLM2 by default) and keeps a modest mixed load on it
for the duration: SSE and WebSocket streams (chat and completions), a share of them cut off at
random points (before the first token, mid-stream, a WebSocket cancel), and bad requests among
the good ones (invalid JSON, max_tokens too large, an unknown role). Every few seconds it
samples the server's resident memory (VmRSS) and /metrics. At the end, once idle, it checks:

  rss_growth      RSS at the end vs. right after warm-up grew less than --max-rss-growth (5%)
  no_leaked_kv    KV cache usage is exactly 0 (every block free) once idle
  no_5xx          no 5xx status and no server error inside a stream or on the socket
  no_stuck        no request ran past its timeout; nothing running or waiting at the end
  good_ok         every good request that was not cut finished with its full token count
  bad_refused     every bad request got a 400 (over HTTP) or an error message (socket)

It prints a table of figures and PASS/FAIL per property, writes the JSON (results/soak.json),
and exits 0 only if every property holds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtest.records import RequestRecord
from loadtest.serve_process import ROOT, kvserve_spec, start_server, stop_server, wait_ready
from loadtest.soak_checks import Tally, check, report, sampler, wait_idle
from loadtest.sse_client import StreamRequest, stream_request
from loadtest.ws_client import WSClient

TOPICS = ("a KV cache", "the moon", "rivers", "a small city", "bread", "winter", "trains",
          "the colour blue", "paged attention", "a quiet garden")
BAD_BODIES = (b"{not json", b'{"prompt": "hi", "max_tokens": 1000000}',
              b'{"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}')


def good_request(rng: random.Random) -> StreamRequest:
    """A chat or completion of 8-48 tokens about a random topic."""
    topic = rng.choice(TOPICS)
    params = {"max_tokens": rng.randint(8, 48), "temperature": rng.choice((0.0, 0.7)),
              "ignore_eos": True}
    if rng.random() < 0.5:
        return StreamRequest("chat", {**params, "messages": [
            {"role": "user", "content": f"Write two sentences about {topic}."}]})
    return StreamRequest("completions", {**params, "prompt": f"A short note on {topic}:"})


def judge(record: RequestRecord, req: StreamRequest, tally: Tally, transport: str) -> None:
    """Files a finished good request under ok, 5xx, stuck or failed."""
    if record.ok and record.output_tokens == req.payload["max_tokens"]:
        tally.outcomes[f"ok_{transport}"] += 1
    elif record.error_kind == "timeout":
        tally.problem("stuck", record.error)
    elif (record.status or 0) >= 500 or "server_error" in record.error_kind or \
            record.error_kind == "stream_error":
        tally.problem("5xx", f"{record.error_kind} {record.error}")
    else:
        tally.problem("good_failed", f"{record.error_kind} {record.error} "
                                     f"tokens={record.output_tokens}")


class Cut(Exception):
    """Raised from a chunk hook to drop a stream there (the response is closed mid-body)."""


async def sse_cut(session: aiohttp.ClientSession, url: str, req: StreamRequest,
                  rng: random.Random, timeout_s: float, tally: Tally) -> None:
    """An SSE stream dropped at its first chunk or after a few chunks."""
    after, seen = rng.choice((0, 1, 3, 8)), [0]

    def hook(chunk: dict[str, Any]) -> None:
        seen[0] += 1
        if seen[0] > after:
            raise Cut

    try:
        record = await stream_request(session, url, req, timeout_s=timeout_s, on_chunk=hook)
    except Cut:
        tally.outcomes["cut_sse"] += 1
        return
    if (record.status or 0) >= 500:
        tally.problem("5xx", f"HTTP {record.status}")
    elif record.error_kind == "timeout":
        tally.problem("stuck", "a stream to be cut produced nothing in time")
    else:  # it ended before the cut point
        tally.outcomes["cut_sse"] += 1


async def ws_cut(ws: WSClient, req: StreamRequest, rng: random.Random, timeout_s: float,
                 tally: Tally) -> None:
    """A WebSocket request cancelled by message after a random delay."""
    task = asyncio.create_task(ws.stream(req, timeout_s=timeout_s))
    await asyncio.sleep(rng.uniform(0.0, 1.5))
    task.cancel()
    results = await asyncio.gather(task, return_exceptions=True)
    if isinstance(results[0], RequestRecord) and not results[0].ok:
        judge(results[0], req, tally, "ws")  # it failed before the cancel
    else:
        tally.outcomes["cut_ws"] += 1


async def bad_request(session: aiohttp.ClientSession, ws: WSClient, url: str,
                      rng: random.Random, tally: Tally) -> None:
    """Invalid JSON, max_tokens too large or an unknown role; a 400 (or a socket error)."""
    body = rng.choice(BAD_BODIES)
    if rng.random() < 0.3 and body != BAD_BODIES[0]:
        message = orjson.loads(body)
        kind = "chat" if "messages" in message else "completions"
        record = await ws.stream(StreamRequest(kind, message), timeout_s=30)
        refused = record.error_kind == "ws_error:invalid_request_error"
        tally.outcomes["bad_refused" if refused else "bad_not_refused"] += 1
        return
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    async with session.post(url + path, data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status >= 500:
            tally.problem("5xx", f"HTTP {resp.status} for a bad request")
        tally.outcomes["bad_refused" if resp.status == 400 else "bad_not_refused"] += 1


async def client(url: str, seed: int, deadline: float, timeout_s: float, tally: Tally) -> None:
    """One load client: a request at a time until the deadline, over SSE or its socket."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session, WSClient(url) as ws:
        while time.monotonic() < deadline:
            roll, req = rng.random(), good_request(rng)
            if roll < 0.45:
                judge(await stream_request(session, url, req, timeout_s=timeout_s), req,
                      tally, "sse")
            elif roll < 0.70:
                judge(await ws.stream(req, timeout_s=timeout_s), req, tally, "ws")
            elif roll < 0.80:
                await sse_cut(session, url, req, rng, timeout_s, tally)
            elif roll < 0.90:
                await ws_cut(ws, req, rng, timeout_s, tally)
            else:
                await bad_request(session, ws, url, rng, tally)


async def soak(url: str, pid: int, args: argparse.Namespace) -> tuple[Tally, dict[str, Any]]:
    """Runs the load and the sampler; returns the tally and the final idle sample."""
    tally, t0 = Tally(), time.monotonic()
    deadline = t0 + args.minutes * 60
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(url, pid, t0, args.sample_s, stop, tally))
    await asyncio.gather(*(client(url, args.seed + i, deadline, args.timeout_s, tally)
                           for i in range(args.concurrency)))
    stop.set()
    await sampling
    return tally, await wait_idle(url, pid, t0, 60.0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="load duration")
    parser.add_argument("--model", default="default",
                        help="model path, or 'default' for the embedded SmolLM2")
    parser.add_argument("--threads", type=int, default=1, help="server torch threads")
    parser.add_argument("--concurrency", type=int, default=4, help="load clients at once")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=180.0, help="per request")
    parser.add_argument("--sample-s", type=float, default=5.0, help="sampling interval")
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=ROOT / "results" / "soak.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Soaks a fresh server, prints and writes the verdicts; 0 only if every property holds."""
    args = parse_args(argv)
    model = None if args.model == "default" else Path(args.model)  # None: kvserve's default
    log_dir = args.json.parent
    spec = kvserve_spec(model, args.threads, args.max_num_seqs, log_dir,
                        ["--max-model-len", "1024"])
    spec.log_path = log_dir / "soak_kvserve.log"
    server = start_server(spec)
    try:
        wait_ready(server, 300.0)
        print(f"kvserve up (pid {server.proc.pid}); soaking for {args.minutes:g} min "
              f"with {args.concurrency} clients", flush=True)
        tally, final = asyncio.run(soak(spec.base_url, server.proc.pid, args))
    finally:
        exit_code = stop_server(server)
    figures, passed = check(tally, final, args)
    figures["server_exit_code"] = exit_code
    report(figures, passed, tally.problems)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_bytes(orjson.dumps(
        {"figures": figures, "passed": passed, "problems": tally.problems,
         "samples": tally.samples, "server": spec.command_line()},
        option=orjson.OPT_INDENT_2))
    print(f"\nwrote {args.json}; overall {'PASS' if all(passed.values()) else 'FAIL'}")
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
